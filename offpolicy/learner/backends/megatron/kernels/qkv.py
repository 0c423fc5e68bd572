"""Self-attention whose q/k/v split, q/k head norms and RoPE are one Triton pass each way (`FusedSelfAttention`).

megatron-core's `SelfAttention` views the fused projection's output `[s, b, ng, (np/ng + 2) hn]` (per query
group: its np/ng query heads, then its key and its value head), splits it, copies the strided query into
`[s, b, np, hn]` (`reshape`), runs the q and k norms (qk-norm attention: Qwen3), then RoPE on q and k, and the
core attention makes k and v contiguous; the backward runs each of those in turn and joins the three gradients
with a `cat`. Here one forward kernel reads each head row of the projection once and writes q `[s, b, np, hn]`,
k and v `[s, b, ng, hn]`, contiguous:

    q, k rows   y = x rstd w  (float32, rounded to x's dtype as F.rms_norm's output is; no norm: y = x)
                out = y cos + rotate_half(y) sin  over the first `rot` dims (float32, one rounding), the rest y
    v rows      copied
with rstd = 1 / sqrt(mean(x^2) + eps) and the cos / sin tables of the token's position (`rope.tables`: megatron's
cos(freqs) mscale and sin(freqs) mscale in x's dtype; megatron's non-interleaved `_rotate_half`, (-y2, y1)). The
backward kernel reads the three gradients and x once and writes the projection's gradient in its own layout (no
`cat`): dy = the rotation's transpose of dout (float32), then the RMSNorm backward (rstd recomputed from x),
    dx = (g - x_hat mean(x_hat g)) rstd,  g = dy w,  x_hat = x rstd;   dw = sum over rows of dy x_hat
the weights' gradients as per-program float32 partials (programs looping over row blocks) summed by torch. The
unfused path rounds dy to x's dtype between RoPE's and the norm's backward; here it stays float32.

`FusedSelfAttention` takes megatron's rotary embedding away from `SelfAttention.forward` and does the
rotation inside `get_query_key_value_tensors` when every condition of `_fusable` holds: Triton runs
(moe_triton.available), plain self-attention without an inference context, non-interleaved RoPE (plain or YaRN:
mscale from megatron's own function) on both q and k, sbhd layout, both head norms offpolicy's RMSNorm `Norm`s
or neither, no output gate, no MLA, no context parallelism, as many query groups as TP ranks or more. Otherwise
megatron's own path runs unchanged. Tested in Triton's interpreter against that path (tests/unit/
test_megatron_qkv.py) and on a GPU (tests/gpu/test_megatron_qkv_gpu.py).
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.transformer.attention import SelfAttention

from offpolicy.learner.backends.megatron.kernels import moe_triton, norms, rope

BR = 32  # head rows a program step
WARPS = 4


def fused_qkv(mixed: torch.Tensor, groups: int, per_group: int, head: int, cos_: torch.Tensor, sin_: torch.Tensor,
              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [s, b, groups * per_group, head], k and v [s, b, groups, head]) of the projection `mixed`
    [s, b, groups * (per_group + 2) * head] (module docstring); `cos_`, `sin_` [s, 1, 1, rot] in mixed's dtype
    (a row per sequence position: per token in a packed [T, 1] micro-batch); both weights or neither.
    Differentiable in mixed and the weights."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("fused_qkv: both head norms or neither")
    return _FusedQKV.apply(mixed, q_weight, k_weight, cos_, sin_, groups, per_group, head, float(eps))


class _FusedQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, q_weight, k_weight, cos_, sin_, groups, per_group, head, eps):
        s, b = mixed.shape[0], mixed.shape[1]
        x = mixed.contiguous()
        rot = cos_.shape[-1]
        if rot % 2 or rot > head or cos_.shape[0] != s or cos_.numel() != s * rot:
            raise ValueError(f"fused_qkv: tables {tuple(cos_.shape)} for a sequence of {s} and heads of {head}")
        cos_, sin_ = cos_.reshape(-1, rot).contiguous(), sin_.reshape(-1, rot).contiguous()
        q = x.new_empty((s, b, groups * per_group, head))
        k, v = (x.new_empty((s, b, groups, head)) for _ in range(2))
        rows = s * b * groups * (per_group + 2)
        per_row = b  # tokens of the flattened [s, b] one table row serves
        has_norm = q_weight is not None
        qw, kw = (q_weight.contiguous(), k_weight.contiguous()) if has_norm else (x, x)
        if rows:
            _kernels().qkv_forward[(-(-rows // BR),)](
                x, cos_, sin_, qw, kw, q, k, v, rows, per_row, eps, G=groups, QPG=per_group, D=head, ROT=rot,
                HAS_NORM=has_norm, BR=BR, BD=_pow2(head), num_warps=WARPS)
        ctx.save_for_backward(x, cos_, sin_, qw, kw)
        ctx.consts = (groups, per_group, head, rot, per_row, eps, has_norm)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, cos_, sin_, qw, kw = ctx.saved_tensors
        groups, per_group, head, rot, per_row, eps, has_norm = ctx.consts
        s, b = x.shape[0], x.shape[1]
        rows = s * b * groups * (per_group + 2)
        shapes = ((s, b, groups * per_group, head), (s, b, groups, head), (s, b, groups, head))
        dq, dk, dv = (x.new_zeros(shape) if g is None else g.contiguous() for g, shape in zip((dq, dk, dv), shapes))
        dx = torch.empty_like(x)
        programs = max(1, min(-(-rows // BR), norms.backward_programs(x)))
        partial = torch.empty((programs, 2, head), dtype=torch.float32, device=x.device)  # every program writes its row
        if rows:
            _kernels().qkv_backward[(programs,)](
                x, cos_, sin_, qw, kw, dq, dk, dv, dx, partial, rows, per_row, eps, G=groups, QPG=per_group, D=head,
                ROT=rot, HAS_NORM=has_norm, BR=BR, BD=_pow2(head), num_warps=WARPS)
        dqw = dkw = None
        if has_norm:
            dw = partial.sum(0)
            dqw = dw[0].to(qw.dtype) if ctx.needs_input_grad[1] else None
            dkw = dw[1].to(kw.dtype) if ctx.needs_input_grad[2] else None
        return dx, dqw, dkw, None, None, None, None, None, None


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _kernels():
    from offpolicy.learner.backends.megatron.kernels import qkv_kernels  # Triton imports wherever fused_runs holds

    return qkv_kernels


def fused_runs(t: torch.Tensor) -> bool:
    """Whether the fused kernels run on `t` (moe_triton.available: CUDA or the interpreter, not under
    OFFPOLICY_EAGER_KERNELS=1)."""
    return moe_triton.available(t)


class FusedSelfAttention(SelfAttention):
    """megatron-core's SelfAttention (same parameters) with the q/k/v split, head norms and RoPE fused (module
    docstring) where `_fusable` holds."""

    _rope: tuple[torch.Tensor, float] | None = None

    def forward(self, *args, **kwargs):
        bound = _forward_signature(type(self)).bind(self, *args, **kwargs)
        arg = bound.arguments
        freqs = self._fusable(arg)
        if freqs is None:
            return super().forward(*args, **kwargs)
        from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

        arg["rotary_pos_emb"] = None  # rotated here, in get_query_key_value_tensors
        self._rope = (freqs, float(_yarn_get_concentration_factor_from_config(self.config)))
        try:
            return super().forward(*bound.args[1:], **bound.kwargs)
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args, **kwargs):
        if self._rope is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, *args, **kwargs)
        freqs, mscale = self._rope
        mixed, _ = self.linear_qkv(hidden_states)
        cos_, sin_ = rope.tables(freqs, mscale, mixed.dtype)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        qn, kn = self.q_layernorm, self.k_layernorm
        norm = isinstance(qn, norms.Norm)
        return fused_qkv(mixed.view(*mixed.shape[:2], -1), groups, per_group, self.hidden_size_per_attention_head,
                         cos_, sin_, qn.weight if norm else None, kn.weight if norm else None,
                         qn.eps if norm else 0.0)

    def _fusable(self, arg: dict) -> torch.Tensor | None:
        """The rotary table `freqs` [s, 1, 1, rot] when the fused path computes this call, else None."""
        c = self.config
        emb, hidden = arg.get("rotary_pos_emb"), arg["hidden_states"]
        if isinstance(emb, tuple):
            emb = emb[0] if len(emb) == 2 and emb[0] is emb[1] else None
        packed = arg.get("packed_seq_params")
        seq = hidden.shape[0] * (c.tensor_model_parallel_size if c.sequence_parallel else 1)  # after linear_qkv
        if not (isinstance(emb, torch.Tensor) and emb.dim() == 4 and emb.shape[0] == seq and emb.shape[1:3] == (1, 1)
                and emb.shape[-1] % 2 == 0 and emb.shape[-1] <= self.hidden_size_per_attention_head):
            return None
        if (arg.get("key_value_states") is not None or arg.get("inference_context") is not None
                or arg.get("inference_params") is not None or self.attention_type != "self"):
            return None
        if packed is not None and getattr(packed, "qkv_format", None) != "sbhd":
            return None
        if any(getattr(c, f, False) for f in _REFUSED) or c.context_parallel_size != 1 \
                or c.num_query_groups < c.tensor_model_parallel_size:
            return None
        no_rope = getattr(c, "no_rope_freq", None)
        if no_rope and no_rope[self.layer_number - 1]:
            return None
        if not _norms_fusable(self.q_layernorm, self.k_layernorm):
            return None
        return emb if fused_runs(hidden) else None


_REFUSED = ("rotary_interleaved", "multi_latent_attention", "apply_rope_fusion", "test_mode", "attention_output_gate",
            "fused_single_qkv_rope", "mla_rotary_interleaved", "flash_decode")  # TransformerConfig flags it leaves


def _norms_fusable(qn, kn) -> bool:
    """Both head norms offpolicy's RMSNorm (one weight each) or neither."""
    if qn is None and kn is None:
        return True
    from megatron.core.transformer.identity_op import IdentityOp

    if isinstance(qn, IdentityOp) and isinstance(kn, IdentityOp):
        return True
    return all(isinstance(n, norms.Norm) and n.rms for n in (qn, kn))


_SIGNATURES: dict[type, inspect.Signature] = {}


def _forward_signature(cls: type) -> inspect.Signature:
    """megatron's SelfAttention.forward signature (self first), read once."""
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(SelfAttention.forward)
    return _SIGNATURES[cls]
