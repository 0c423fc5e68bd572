"""Core attention for megatron-core's local layer spec: fused flash kernels over padded or packed micro-batches.

megatron-core's local `DotProductAttention` materialises [b, heads, s, s] scores (baddbmm, softmax) and
refuses packed sequences. `CoreAttention` subclasses it, so it keeps its parameters (the learnable
`softmax_offset` sinks, one per head of this TP rank) and checkpoint keys, and replaces the forward:

- padded micro-batch, q `[s, b, heads, d]`: b causal rows of length s (right padding is exact);
- packed micro-batch, q `[T, 1, heads, d]` with a `Packing` (megatron's PackedSeqParams, qkv_format
  "sbhd"): documents at `cu_seqlens_q`, each causal, none seeing another.

Honoured from the TransformerConfig: `window_size` = (left, 0) on the layers `window_attn_skip_freq`
selects (key j visible to query i iff i - left <= j <= i: megatron's `get_sliding_window_causal_mask`
and flash-attention's convention); grouped-query attention; `softmax_type` "vanilla", "off-by-one" and
"learnable" (sinks, megatron's `SoftmaxOne`): p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k)) over the
scaled scores s, i.e. out = out_flash * sigmoid(lse - sink_h). Refused with a ValueError naming the
field: attention dropout, a right window (non-causal), a non-causal mask type, an explicit
attention_mask or attention_bias (nothing in this backend passes one).

Kernels (`kernel`): on CUDA in bf16/fp16, flash-attention's varlen kernels through
`torch.ops.aten._flash_attention_forward/backward` (the ops `torch.nn.attention.varlen` calls); the sinks'
scaling each way is one compiled kernel (`compile_sinks`, learner.megatron.compile). With
sinks the backward takes grad_out * sigma and the sink-scaled output: flash's row term
D = rowsum(dO * O) then equals the true D minus the lse gradient sigma (1 - sigma) rowsum(dF * O), which
is exactly the gradient through lse, so the flash backward stays exact. On CUDA in float32 (flash has no
float32 kernel; a float32 learner such as configs/smollm2-arithmetic-megatron.yaml) without sinks:
`padded_attention`, the documents right-padded into rows of similar length and SDPA's fused causal kernels
(a few calls a layer instead of one small matmul chain per document: with 512 short documents a micro-batch
the per-document loop was most of a step, docs/megatron.md). Elsewhere (CPU; float32 with sinks) `reference_attention`:
per document, scores in the input dtype and a float32 softmax, as megatron's unfused path computes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from offpolicy.learner.backends.megatron.kernels.compiled import tokens_dynamic


@dataclass
class Packing(PackedSeqParams):
    """The documents of a packed micro-batch: device `cu_seqlens_q` (int32) and the same bounds on the host."""

    bounds: tuple[int, ...] = ()


def packing(bounds: list[int], device: torch.device) -> Packing:
    """A `Packing` for documents [bounds[i], bounds[i+1]) of a packed micro-batch."""
    cu = torch.tensor(bounds, dtype=torch.int32)
    cu = cu.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else cu.to(device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return Packing(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                   max_seqlen_kv=longest, bounds=tuple(bounds))


class CoreAttention(DotProductAttention):
    """megatron-core's DotProductAttention (same parameters) with a flash forward over padded or packed rows."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, **kwargs)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout {dropout}: the packed core attention runs without dropout; set it to 0")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type {attn_mask_type}: the packed core attention is causal only")
        self.left = -1  # unlimited
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size {tuple(config.window_size)}: only causal windows (left, 0) are supported")
            self.left = -1 if left is None or left < 0 else int(left)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("the packed core attention takes no attention_mask / attention_bias (causal rows only)")
        s, b, heads, dim = query.shape
        if packed_seq_params is not None:
            if b != 1 or not isinstance(packed_seq_params, Packing):
                raise ValueError("a packed micro-batch is one row [T, 1, ...] with an offpolicy attention.Packing")
            bounds, longest = list(packed_seq_params.bounds), packed_seq_params.max_seqlen_q
            cu = packed_seq_params.cu_seqlens_q
            q, k, v = query.squeeze(1), key.squeeze(1), value.squeeze(1)  # views each way (a select's backward
            # would fill a zero gradient and copy into it)
        else:  # b rows of length s: flatten row-major so each row is one document
            bounds, longest = [i * s for i in range(b + 1)], s
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
            q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], dim) for t in (query, key, value))
        sink = self.softmax_offset  # None (vanilla), zeros (off-by-one) or the learnable parameter
        how = kernel(query, sink)
        if how == "flash":
            out = _Flash.apply(q.contiguous(), k.contiguous(), v.contiguous(), sink, cu, longest,
                               self.softmax_scale, self.left)
        elif how == "padded":
            out = padded_attention(q, k, v, bounds, self.softmax_scale, self.left)
        else:
            out = reference_attention(q, k, v, bounds, self.softmax_scale, self.left, sink)
        if packed_seq_params is None:
            return out.view(b, s, heads * dim).transpose(0, 1).contiguous()
        return out.view(s, 1, heads * dim)


def kernel(query: torch.Tensor, sink: torch.Tensor | None) -> str:
    """Which kernel computes attention for `query`: "flash", "padded" or "reference" (the module's docstring)."""
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return "flash"
    if query.is_cuda and sink is None:
        return "padded"
    return "reference"


def padded_rows(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Documents (indices into `lengths`) grouped into rows of one padded length: longest first, a row takes the
    next document while its padded slots stay within (1 + waste) x its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    real = 0  # tokens of the row being filled
    for i in order:
        if rows and (len(rows[-1]) + 1) * lengths[rows[-1][0]] <= (1 + waste) * (real + lengths[i]):
            rows[-1].append(i)
            real += lengths[i]
        else:
            rows.append([i])
            real = lengths[i]
    return rows


@functools.lru_cache(maxsize=8)
def _padded_index(bounds: tuple[int, ...], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per row of `padded_rows`: the gather index [docs, L] into the packed tokens (a padded slot repeats its
    document's last token), the mask of real slots, and the real slots' packed positions. Cached: every layer
    of a micro-batch asks with the same bounds."""
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds, bounds[1:])]
    out = []
    for row in padded_rows(lengths):
        j = torch.arange(lengths[row[0]])
        n = torch.tensor([lengths[i] for i in row])
        index = torch.tensor([starts[i] for i in row])[:, None] + torch.minimum(j[None, :], n[:, None] - 1)
        real = j[None, :] < n[:, None]
        out.append((index.to(device), real.to(device), index[real].to(device)))
    return out


def padded_attention(q, k, v, bounds: list[int], scale: float, left: int = -1) -> torch.Tensor:
    """`reference_attention` (no sinks) through SDPA: each row of `padded_rows` gathers its documents right-padded
    to its longest, [docs, H, L, d] (causal rows never see a padded slot: it comes after every real one), and
    scatters the real tokens' outputs back. Autograd through gather, SDPA and scatter."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for index, real, positions in _padded_index(tuple(bounds), q.device):
        qr = q[index].transpose(1, 2)  # [docs, H, L, d]
        kr, vr = (t[index].repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
        if left >= 0:  # key j visible to query i iff i - left <= j <= i
            i = torch.arange(index.shape[1], device=q.device)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= left)
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)
        out[positions] = o.transpose(1, 2)[real]
    return out


def reference_attention(q, k, v, bounds: list[int], scale: float, left: int = -1, sink=None) -> torch.Tensor:
    """Causal attention per document [bounds[i], bounds[i+1]) of q `[T, H, d]`, k/v `[T, Hkv, d]` -> `[T, H, d]`."""
    groups = q.shape[1] // k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax's dtype (float64 stays float64)
    out = torch.empty_like(q)
    for a, b in zip(bounds, bounds[1:]):
        n = b - a
        qd = q[a:b].transpose(0, 1)  # [H, n, d]
        kd = k[a:b].repeat_interleave(groups, dim=1).transpose(0, 1)
        vd = v[a:b].repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = (torch.bmm(qd, kd.transpose(1, 2)) * scale).to(wide)
        i = torch.arange(n, device=q.device)
        hidden = i[None, :] > i[:, None]
        if left >= 0:
            hidden = hidden | (i[:, None] - i[None, :] > left)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sink is not None:
            col = sink.to(wide).view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.bmm(probs.to(q.dtype), vd).transpose(0, 1)
    return out


class _Flash(torch.autograd.Function):
    """Flash-attention varlen forward/backward (causal, optional left window and per-head sinks)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu, longest: int, scale: float, left: int):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale, window_size_left=left,
            window_size_right=0)
        if sink is not None:  # lse [H, T]: the softmax gains exp(sink) in its denominator
            tokens_dynamic(_KERNELS, (out, 0), (lse, 1))
            out = _KERNELS["sink_scaled"](out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused, sink)
        ctx.args = (longest, scale, left)
        ctx.sink_grad = sink is not None and sink.requires_grad
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, rng, unused, sink = ctx.saved_tensors
        longest, scale, left = ctx.args
        grad_sink = None
        if sink is None:
            grad = grad.contiguous()
        else:
            tokens_dynamic(_KERNELS, (grad, 0), (out, 0), (lse, 1))
            grad, grad_sink = _KERNELS["sink_backward"](grad, out, lse, sink, ctx.sink_grad)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused, scale=scale,
            window_size_left=left, window_size_right=0)
        return dq, dk, dv, grad_sink, None, None, None, None


def _sigma(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """sigmoid(lse - sink) as `[T, H, 1]` from lse `[H, T]` and sink `[H]`."""
    return torch.sigmoid(lse - sink.float()[:, None]).t().unsqueeze(-1)


def sink_scaled(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Flash's output `[T, H, d]` times sigmoid(lse - sink): the softmax with exp(sink) in its denominator."""
    return (out.float() * _sigma(lse, sink)).to(out.dtype)


def sink_backward(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, sink_grad: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad * sigma for flash's backward, in grad's dtype; the sinks' gradient -sum_t (1 - sigma)
    rowsum(grad * out), or None without `sink_grad`) of the sink-scaled output `out` (`sink_scaled`'s)."""
    sig, g = _sigma(lse, sink), grad.float()
    grad_sink = -((g * out.float()).sum(-1) * (1 - sig[..., 0])).sum(0).to(sink.dtype) if sink_grad else None
    return (g * sig).to(grad.dtype), grad_sink


_KERNELS = {"sink_scaled": sink_scaled, "sink_backward": sink_backward}


def compile_sinks() -> None:
    """torch.compile `sink_scaled` and `sink_backward` (GPU): one kernel each way over the layer's output where
    eager makes float32 copies of it and multiplies and casts them in passes of their own (GPT-OSS: a visible part
    of the body's step, docs/benchmarks.md "MoE learner speed"). Process-wide, idempotent; the token count
    symbolic (one compile each)."""
    if "compiled" not in _KERNELS:
        _KERNELS.update(sink_scaled=torch.compile(sink_scaled), sink_backward=torch.compile(sink_backward),
                        compiled=True)

