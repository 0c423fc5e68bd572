"""Grouped-GEMM experts of the Megatron learner: all local experts of a MoE layer in stacked weights.

`GroupedExperts` takes the place of megatron-core's SequentialMLP in the local spec's MoE layer
(`model.build` with learner.megatron.experts=grouped, the default). It gets what the token dispatcher
hands any experts module: this rank's tokens in expert order `x` [T, H], `tokens_per_expert` [E_l] and
each token's router probability `probs` [T]; it returns ([T, H], None). Parameters (E_l local experts,
I_r = moe_ffn_hidden_size / etp, H hidden):
    linear_fc1.weight [E_l, 2 I_r, H]   expert e's fc1 as SequentialMLP's local_experts.<e> holds it ([gate_r; up_r])
    linear_fc1.bias   [E_l, 2 I_r]      (families with expert biases: GPT-OSS)
    linear_fc2.weight [E_l, H, I_r]
    linear_fc2.bias   [E_l, H]
so slice e of each is SequentialMLP's parameter of local expert e, and `sharded_state_dict` writes them
under SequentialMLP's keys and global shapes ([.., E, 2I, H] ...): a distributed checkpoint written with
either module loads into the other.
Math (megatron-core's expert MLP; token t of expert e, p_t its probability):
    h = x_t W1_e^T + b1_e;  g, u = the halves of h;  g = min(g, limit);  u = clamp(u, -limit, limit)
    y_t = (act(g) (u + offset) p_t) W2_e^T + b2_e p_t
Two paths over the same parameters, chosen per call by `grouped_mm_runs`: `torch._grouped_mm` (one
GEMM launch for all experts each way, forward and backward: CUDA, bf16, compute capability >= 9) and a
per-expert loop (CPU, float32, older GPUs). The clamp, GLU and probability weighting are one elementwise
function (`glu`; the loop's bias adds `add_bias`), compiled on a GPU (`compile_elementwise`); the grouped
path's (`glu_rows`) runs as two Triton kernels on a GPU (moe_triton.py: one pass each way, where inductor's
backward took several times its bytes' time, docs/benchmarks.md), compiled where Triton is missing or
OFFPOLICY_EAGER_KERNELS=1. The grouped path adds the biases without a pass of their own over the rows (the
rows are sorted by expert; `rows` [T] holds each one's local expert):
    fc1's bias   inside the GLU (`glu_rows`: `b1[rows]`, an indexed load), from the bias detached;
                 its gradient is one GEMM of the rows' one-hot experts with h's gradient (`_RowBias`: float32
                 sums, where an indexed gather's backward would scatter-add in bf16 atomics)
    fc2's bias   added to fc2's output by a compiled kernel (`add_bias` with `rows`: p_t b2[rows], indexed
                 loads, one pass; `_AddRowBias`: its backward passes y's gradient through and reduces p's,
                 `bias_dot`), its gradient again one GEMM (`_RowBias` with the rows' one-hot experts times p)
where they were GEMMs with one-hot rows before (`addmm`: a copy and a pass over [T, 2I] and over [T, H]
forward; docs/benchmarks.md, "MoE token permutation"). Tried and dropped: fc2's bias as
one more input column of its grouped GEMM ([act | p | 0 x 7] times [W2 | b2 | 0 x 7]): K = I + 8 is no
multiple of the GEMM's 64-wide tiles, and fc2's weight-gradient GEMM took longer (docs/benchmarks.md,
"MoE learner speed"). Nothing here
communicates: the dispatcher does the EP all-to-all and the ETP reductions.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from offpolicy.learner.backends.megatron.arch import sigmoid_gate
from offpolicy.learner.backends.megatron.kernels import moe_triton
from offpolicy.learner.backends.megatron.kernels.compiled import tokens_dynamic


def _gated(g: torch.Tensor, u: torch.Tensor, probs: torch.Tensor, alpha: float | None, limit: float | None,
           offset: float) -> torch.Tensor:
    """`act(gate) * (up + offset) * probs` of the float32 halves `g`, `u` [T, I] of fc1's output, float32."""
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    act = F.silu(g) if alpha is None else g * torch.sigmoid(g * alpha)
    return act * (u + offset) * probs.unsqueeze(-1)


def glu(h: torch.Tensor, bias: torch.Tensor | None, probs: torch.Tensor, alpha: float | None,
        limit: float | None, offset: float) -> torch.Tensor:
    """`act(gate) * (up + offset) * probs` of fc1's output `h` [T, 2I] plus its `bias` [2I], in h's dtype."""
    dtype = h.dtype
    if bias is not None:
        h = h + bias
    g, u = h.chunk(2, dim=-1)  # halves first, then float32: the backward casts each half before joining them
    return _gated(g.float(), u.float(), probs, alpha, limit, offset).to(dtype)


def glu_rows(h: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor | None, probs: torch.Tensor,
             alpha: float | None, limit: float | None, offset: float) -> torch.Tensor:
    """The grouped path's GLU of expert-sorted rows `h` [T, 2I], fc1's `bias` [E_l, 2I] of each row's expert
    (`rows` [T]) added in float32; h's dtype."""
    g, u = (x.float() for x in h.chunk(2, dim=-1))
    if bias is not None:
        bg, bu = bias.chunk(2, dim=-1)
        g, u = g + bg.index_select(0, rows).float(), u + bu.index_select(0, rows).float()
    return _gated(g, u, probs, alpha, limit, offset).to(h.dtype)


def add_bias(y: torch.Tensor, bias: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor | None = None
             ) -> torch.Tensor:
    """fc2's output plus its bias weighted by each token's probability (megatron-core's expert MLP); with `rows`
    [T], the bias [E_l, H] of each row's expert."""
    if rows is not None:
        bias = bias.index_select(0, rows)
    return (y.float() + bias.float() * probs.unsqueeze(-1)).to(y.dtype)


def bias_dot(g: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The probabilities' gradient [T] of `add_bias` with `rows`: <g_t, b2[rows_t]> in float32."""
    return (g.float() * bias.index_select(0, rows).float()).sum(-1)


_KERNELS = {"glu": glu, "add_bias": add_bias, "glu_rows": glu_rows, "bias_dot": bias_dot}


def compile_elementwise() -> None:
    """torch.compile `glu`, `glu_rows` and `add_bias` (one fused kernel each way); process-wide, idempotent;
    GPU only. Only the token count is symbolic (`_token_dim_dynamic`, from the first call: one compile each
    way instead of a static one for the first micro-batch and a dynamic one at the second); the widths stay
    constants (with every size symbolic, dynamic=True, the GLU's halves were indexed through symbolic
    divisions: kernels several times slower, docs/benchmarks.md). The GLUs' backward joins the two halves' gradients
    into fc1's [T, 2I] (the backward of the chunk): inductor on a GPU makes such a join of two elementwise
    results a "pointwise cat", each output element computed from its own half's inputs, which reads the
    gate half twice and the output's gradient twice and leaves the probabilities' gradient to a kernel of
    its own (the GLU's backward took about twice its bytes' time; docs/benchmarks.md).
    `_join_in_place` asks for the join as a buffer whose halves the gradient's kernel writes in place: one
    pass over [T, I] writing both halves, as inductor's CPU code does (its generated code, inspected)."""
    if "compiled" not in _KERNELS:
        opts = _join_in_place()
        _KERNELS.update(glu=torch.compile(glu, options=opts), add_bias=torch.compile(add_bias),
                        glu_rows=torch.compile(glu_rows, options=opts), bias_dot=torch.compile(bias_dot),
                        compiled=True)


def _join_in_place() -> dict[str, int]:
    """Inductor options that keep two-input joins (cat) out of its pointwise-cat lowering (keys this torch has)."""
    from torch._inductor import config

    keys = ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")
    return {k: 1 for k in keys if hasattr(config, k)}


def _token_dim_dynamic(*tensors: torch.Tensor | None) -> None:
    """Mark dim 0 (tokens) of the compiled kernels' inputs dynamic before the call (no-op uncompiled)."""
    tokens_dynamic(_KERNELS, *((t, 0) for t in tensors))


class _RowBias(torch.autograd.Function):
    """y [T, W] itself; backward: y's gradient, and the gradient of `bias` [E_l, W] where a kernel adds
    weights[t, e] bias[e] to row t from the bias detached (fc1: the GLU, one-hot weights; fc2: `add_bias`,
    one-hot times p): weights^T @ grad, one GEMM (float32 sums, where an indexed gather's backward would
    scatter-add in bf16 atomics)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (weights,) = ctx.saved_tensors
        return g, weights.T.mm(g) if ctx.needs_input_grad[1] else None, None


class _AddRowBias(torch.autograd.Function):
    """The grouped path's fc2 bias: `add_bias(y, bias, probs, rows)` with the bias detached (`_RowBias` sums its
    gradient); backward: y's gradient is the output's itself (no pass: autograd through the compiled function
    wrote a copy of it) and p's one reduction (`bias_dot`)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(bias, rows)
        ctx.probs_dtype = probs.dtype
        _token_dim_dynamic(y, probs, rows)
        return _KERNELS["add_bias"](y, bias, probs, rows)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if not ctx.needs_input_grad[2]:
            return g, None, None, None
        bias, rows = ctx.saved_tensors
        _token_dim_dynamic(g, rows)
        return g, None, _KERNELS["bias_dot"](g, bias, rows).to(ctx.probs_dtype), None


def grouped_mm_runs(x: torch.Tensor, *widths: int) -> bool:
    """Whether `torch._grouped_mm` runs on `x` [T, H]: bf16 on a CUDA GPU of compute capability >= 9.0,
    with rows (H and each of `widths`) whose bytes are multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and all(w % 8 == 0 for w in (x.shape[1], *widths)))


def _alpha(func) -> float | None:
    """The sigmoid-gate alpha of TransformerConfig.activation_func (None for silu)."""
    if func is F.silu:
        return None
    if isinstance(func, functools.partial) and func.func is sigmoid_gate:
        return float(func.keywords["alpha"])
    raise ValueError(f"GroupedExperts runs silu or arch.sigmoid_gate gates, not {func!r}: set "
                     "learner.megatron.experts=sequential")


class _Stacked(torch.nn.Module):
    """One linear per local expert, stacked: weight [E_l, out, in], bias [E_l, out] (or None)."""

    def __init__(self, experts: int, out: int, inp: int, bias: bool, dtype: torch.dtype, init) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, out, inp, dtype=dtype))
        init(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(experts, out, dtype=dtype)) if bias else None


class GroupedExperts(MegatronModule):
    """The local experts of one MoE layer (module docstring); built by megatron-core's MoELayer in place of
    SequentialMLP (its arguments: 0.16 through build_module, 0.19 as a partial)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name=None) -> None:
        super().__init__(config=config)
        if not config.gated_linear_unit:
            raise ValueError("GroupedExperts runs gated (GLU) experts only: set learner.megatron.experts=sequential")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        etp, hidden = self.tp_group.size(), config.hidden_size
        self.ffn = config.moe_ffn_hidden_size // etp
        self.alpha, self.limit = _alpha(config.activation_func), config.activation_func_clamp_value
        self.offset = float(config.glu_linear_offset)
        self.grouped = True  # False: always the per-expert loop (tests compare the two paths on a GPU)
        bias, dtype = config.add_bias_linear, config.params_dtype
        self.linear_fc1 = _Stacked(num_local_experts, 2 * self.ffn, hidden, bias, dtype, config.init_method)
        self.linear_fc2 = _Stacked(num_local_experts, hidden, self.ffn, bias, dtype, config.output_layer_init_method)
        # the attributes megatron-core's expert linears give their parameters (DDP, optimizer, grad norm read them)
        expert_parallel = config.expert_model_parallel_size > 1
        for p, dim in ((self.linear_fc1.weight, 1), (self.linear_fc1.bias, 1), (self.linear_fc2.weight, 2),
                       (self.linear_fc2.bias, None)):
            if p is None:
                continue
            p.allreduce = not expert_parallel
            if dim is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, **_):
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        glu_, add = _KERNELS["glu"], _KERNELS["add_bias"]
        act = functools.partial(glu_, alpha=self.alpha, limit=self.limit, offset=self.offset)
        if self.grouped and x.shape[0] and grouped_mm_runs(x, self.ffn):
            return self._grouped(x, tokens_per_expert, probs), None
        outs = []
        splits = [int(n) for n in tokens_per_expert.tolist()]
        for e, (xe, pe) in enumerate(zip(x.split(splits), probs.split(splits))):
            h = xe @ fc1.weight[e].T
            _token_dim_dynamic(h, pe)
            a = act(h, fc1.bias[e] if fc1.bias is not None else None, pe)
            y = a @ fc2.weight[e].T
            _token_dim_dynamic(y)
            outs.append(add(y, fc2.bias[e], pe) if fc2.bias is not None else y)
        return torch.cat(outs), None

    def _grouped(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The grouped GEMMs' forward (module docstring); no host synchronisation."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        counts = tokens_per_expert.to(x.device, non_blocking=True)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(x, fc1.weight.transpose(1, 2), offs=offs)
        rows = onehot = bias = None
        if fc1.bias is not None or fc2.bias is not None:  # each row's local expert
            experts = torch.arange(self.num_local_experts, device=x.device)
            rows = torch.repeat_interleave(experts, counts, output_size=x.shape[0])
            onehot = (rows.unsqueeze(1) == experts).to(x.dtype)
        if fc1.bias is not None:
            h = _RowBias.apply(h, fc1.bias, onehot)
            bias = fc1.bias.detach()
        if moe_triton.available(h):
            a = moe_triton.glu_rows(h, bias, rows, probs, self.alpha, self.limit, self.offset)
        else:
            _token_dim_dynamic(h, probs, rows)
            a = _KERNELS["glu_rows"](h, bias, rows, probs, self.alpha, self.limit, self.offset)
        y = torch._grouped_mm(a, fc2.weight.transpose(1, 2), offs=offs)
        if fc2.bias is None:
            return y
        y = _RowBias.apply(y, fc2.bias, onehot * probs.detach().unsqueeze(1).to(x.dtype))
        return _AddRowBias.apply(y, fc2.bias.detach(), probs, rows)

    def backward_dw(self) -> None:  # MoELayer calls it only with delayed weight gradients, which are off
        pass

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP's checkpoint entries (keys, global shapes, replica ids) of the stacked parameters."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError("GroupedExperts: singleton_local_shards checkpoints are not written")
        axis = len(sharded_offsets)  # the expert axis comes after the layer axis of the block
        ep = (axis, self.ep_group.rank(), self.ep_group.size())
        etp, etp_rank, edp = self.tp_group.size(), self.tp_group.rank(), self.dp_group.rank()
        key = f"{prefix}experts."  # SequentialMLP's sharded key of every local expert (prefix: "...mlp.experts.")

        def tensor(name: str, data, *offsets, replica) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(name, data, *sharded_offsets, ep, *offsets,
                                                   replica_id=replica, prepend_axis_num=axis)

        def fc1(name: str, param) -> ShardedTensorFactory:  # [gate_r; up_r] -> rows r and etp + r of 2 etp
            def build(k, t, replica, flattened_range):  # k: the factory's key, as the block re-prefixed it
                if flattened_range is not None:
                    raise NotImplementedError("GroupedExperts: flattened checkpoint ranges are not written")
                gate, up = t.chunk(2, dim=1)
                return [tensor(k, gate, (axis + 1, etp_rank, 2 * etp), replica=replica),
                        tensor(k, up, (axis + 1, etp_rank + etp, 2 * etp), replica=replica)]

            return ShardedTensorFactory(key + name, param, build, lambda parts: torch.cat(parts, dim=1), (0, 0, edp))

        out = {f"{prefix}linear_fc1.weight": fc1("linear_fc1.weight", self.linear_fc1.weight),
               f"{prefix}linear_fc2.weight": tensor(key + "linear_fc2.weight", self.linear_fc2.weight,
                                                    (axis + 2, etp_rank, etp), replica=(0, 0, edp))}
        if self.linear_fc1.bias is not None:
            out[f"{prefix}linear_fc1.bias"] = fc1("linear_fc1.bias", self.linear_fc1.bias)
            out[f"{prefix}linear_fc2.bias"] = tensor(key + "linear_fc2.bias", self.linear_fc2.bias,
                                                     replica=(0, etp_rank, edp))
        # SequentialMLP's linears also write an (empty) extra state per expert, which its loader asks for
        shape, offset = tuple(o[2] for o in sharded_offsets), tuple(o[1] for o in sharded_offsets)
        first = self.ep_group.rank() * self.num_local_experts
        for i in range(self.num_local_experts):
            for linear in ("linear_fc1", "linear_fc2"):
                out[f"{prefix}{_EXTRA.format(i=i, linear=linear)}"] = ShardedObject(
                    f"{key}{linear}._extra_state", None, (*shape, self.ep_group.size() * self.num_local_experts),
                    (*offset, first + i), replica_id=(0, etp_rank, edp))
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        extra = [k for k in unexpected_keys if k.startswith(prefix + "local_experts.") and k.endswith("._extra_state")]
        for k in extra:  # SequentialMLP's empty extra states (sharded_state_dict): nothing to load
            unexpected_keys.remove(k)


_EXTRA = "local_experts.{i}.{linear}._extra_state"
