"""MoE token permutation by gathers: megatron-core's unfused permute / unpermute without atomics.

The token dispatchers (alltoall, allgather) sort each token's copies by expert before the experts run
(`permute`) and sum every token's expert outputs back afterwards (`unpermute`). megatron-core's unfused
versions (no Transformer Engine) scatter-add in the unpermute and index-add in the permute's backward:
atomics, in bf16, contended k ways. Here the sort is done once per forward as a `Routing` of a
routing map [N, E] (N tokens, E experts, at most k = min(topk, E) per token, M = the tokens' copies):
    sorted  [M]     the token of permuted row j (expert-major, tokens ascending: megatron's order)
    flat    [M]     t * E + e of row j: its place in the row-major routing map and probs [N, E]
    inverse [N, k]  the permuted rows of token t's copies in expert order; M (a zero row) where a token
                    has fewer than k copies (`full` = every token has exactly k: M == N k, then no padding)
and every pass is a gather:
    permute        out[j] = x[sorted[j]]                 backward: grad_x[t] = sum_s g[inverse[t, s]]
    unpermute      out[t] = sum_s y[inverse[t, s]] (x p)  backward: grad_y[j] = g[sorted[j]] (x p[flat[j]])
                                                                   grad_p[flat[j]] = <g[sorted[j]], y[j]>
(permuted probs: a gather by `flat`, whose backward writes each row's gradient to its own place). Sums
over a token's k copies run in one reduction (float32 accumulation, one rounding), where megatron's
scatter-add rounds after each copy in the tokens' dtype. The Routing is built with cumulative sums and
scatters to unique places on the device: no host synchronisation (the permuted size M comes from the
dispatcher, which knows it on the host: N x topk without token dropping).

Routing probabilities stay where megatron-core 0.16-0.19 apply them: their alltoall and allgather
dispatchers permute them beside the tokens and the experts multiply (experts.GroupedExperts: in its GLU,
the bias GEMM's one-hot rows), and `unpermute` receives none; it still weights by probs when a caller
passes them, as megatron's does.

`install(mode, tconfig)` (learner.megatron.moe_permute) puts `megatron_permute`, `megatron_unpermute` and
`megatron_sort_chunks` in the dispatcher module in place of the functions it imported from moe_utils
(with mode "megatron" it puts megatron's back). They keep megatron's signatures of 0.16 (permute returns 3
values) and 0.19 (5 values; `tokens_per_expert`, `align_size`, `pad_offsets`) and hand anything they do
not do (fused TE kernels, drop-and-pad, quantisation padding, a permuted size known only on the device,
sorted indices not made here) to megatron's own. `megatron_sort_chunks` skips megatron's chunk reordering
(a split and a cat: one copy of all permuted rows each way) when the order is the identity, which it is
with one expert-parallel and one tensor-parallel rank.
Process-global, idempotent per mode; a model built after `install` uses it. On a GPU the sums of a token's
copies run as a Triton kernel (moe_triton.gathered_sum), else compiled (`compile_sums`, learner.megatron.compile)
where the backend compiles.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from offpolicy.learner.backends.megatron.kernels import moe_triton
from offpolicy.learner.backends.megatron.kernels.compiled import tokens_dynamic
from offpolicy.learner.backends.megatron.kernels.rows import select as select_rows


@dataclass(frozen=True)
class Routing:
    """Where a routing map's token copies go (module docstring); `sorted` travels as the tensor itself."""

    inverse: torch.Tensor  # [N, k] int64, M = no copy
    flat: torch.Tensor  # [M] int64
    experts: int  # E
    full: bool  # every token has exactly k copies (M == N k)

    @property
    def tokens(self) -> int:
        return self.inverse.shape[0]


def routing(routing_map: torch.Tensor, num_out: int, topk: int) -> tuple[torch.Tensor, Routing]:
    """(sorted [M], Routing) of a boolean routing map [N, E] with `num_out` = M true entries, each row at
    most min(topk, E) of them."""
    n, e = routing_map.shape
    k = min(topk, e)
    dev = routing_map.device
    m = routing_map.bool()
    by_expert = m.T.reshape(-1)  # [E N]: q = e N + t
    rank = torch.cumsum(by_expert, 0) - 1  # permuted row of entry q (where true)
    rows = torch.empty(num_out + 1, dtype=torch.long, device=dev)  # + a bin for the false entries
    rows.scatter_(0, torch.where(by_expert, rank, num_out), torch.arange(e * n, device=dev))
    q = rows[:num_out]
    token, expert = q % n, q // n
    slot = _row_cumsum(m) - 1  # [N, E]: the copy's index among its token's copies
    inverse = torch.full((n, k + 1), num_out, dtype=torch.long, device=dev)
    inverse.scatter_(1, torch.where(m, slot, k), torch.where(m, rank.view(e, n).T, num_out))
    return token, Routing(inverse[:, :k], token * e + expert, e, num_out == n * k)


def _row_cumsum(m: torch.Tensor) -> torch.Tensor:
    """torch.cumsum(m, 1) of a boolean [N, E] as int64, by a product with the upper-triangular ones [E, E]: exact
    (0/1 products summed in float32, TF32 included) and one GEMM where torch's scan along the experts is slow on a
    GPU (docs/benchmarks.md)."""
    e = m.shape[1]
    upper = torch.ones(e, e, device=m.device).triu_()
    return (m.float() @ upper).long()


def gathered_sum(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_s rows[inverse[t, s]] of rows [M, H] and indices [N, k] (float32 sums, rows' dtype)."""
    return rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, rows.shape[1]).sum(1)


_KERNELS = {"gathered_sum": gathered_sum}


def compile_sums() -> None:
    """torch.compile `gathered_sum` (GPU): one kernel that reads each token's k rows and writes their sum, where
    eager gathers all M rows into a tensor of their own and then reduces it. Process-wide, idempotent; the row
    and token counts are symbolic (one compile)."""
    if "compiled" not in _KERNELS:
        _KERNELS.update(gathered_sum=torch.compile(gathered_sum), compiled=True)


def _sum_copies(rows: torch.Tensor, r: Routing) -> torch.Tensor:
    """out[t] = sum_s rows[inverse[t, s]] of permuted rows [M, H] (a missing copy adds nothing); on a GPU by
    moe_triton's kernel (its masked loads skip a missing copy: no zero row appended). Always called inside an
    autograd Function: the rows are detached (one compiled graph for both passes)."""
    rows = rows.detach()
    if r.inverse.shape[1] > 1 and moe_triton.available(rows):
        return moe_triton.gathered_sum(rows, r.inverse)
    if not r.full:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    if r.inverse.shape[1] == 1:
        return rows.index_select(0, r.inverse.reshape(-1))
    tokens_dynamic(_KERNELS, (rows, 0), (r.inverse, 0))
    return _KERNELS["gathered_sum"](rows, r.inverse)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sorted_: torch.Tensor, r: Routing) -> torch.Tensor:
        ctx.r = r
        return x.index_select(0, sorted_)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _sum_copies(g.contiguous(), ctx.r), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, sorted_: torch.Tensor, r: Routing) -> torch.Tensor:
        ctx.save_for_backward(sorted_)
        return _sum_copies(y, r)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (sorted_,) = ctx.saved_tensors
        return g.index_select(0, sorted_), None, None


class _UnpermuteWeighted(torch.autograd.Function):
    """unpermute with probs [N, E]: megatron's arithmetic (y times its prob in the promoted dtype, summed,
    cast back to y's dtype)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, probs: torch.Tensor, sorted_: torch.Tensor, r: Routing) -> torch.Tensor:
        ctx.save_for_backward(y, probs, sorted_)
        ctx.r = r
        dt = torch.result_type(y, probs)
        p = probs.reshape(-1).index_select(0, r.flat).to(dt)
        return _sum_copies(y.to(dt) * p.unsqueeze(1), r).to(y.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, probs, sorted_ = ctx.saved_tensors
        r = ctx.r
        dt = torch.result_type(y, probs)
        rows = g.index_select(0, sorted_).to(dt)  # each permuted row's output gradient
        p = probs.reshape(-1).index_select(0, r.flat).to(dt)
        grad_y = (rows * p.unsqueeze(1)).to(y.dtype) if ctx.needs_input_grad[0] else None
        grad_p = None
        if ctx.needs_input_grad[1]:
            dots = (rows * y.to(dt)).sum(1).to(probs.dtype)
            grad_p = probs.new_zeros(probs.numel()).index_copy_(0, r.flat, dots).view_as(probs)
        return grad_y, grad_p, None, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, num_out: int, topk: int,
            probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """megatron's unfused `permute` (drop-free): (permuted tokens [M, H], permuted probs [M] or None,
    sorted indices [M]); the sorted indices carry their Routing for `unpermute`."""
    sorted_, r = routing(routing_map, num_out, topk)
    sorted_._offpolicy_routing = r  # not a field of Routing: no reference cycle
    out = _Permute.apply(tokens, sorted_, r)
    permuted_probs = None if probs is None else select_rows(probs.reshape(-1), r.flat)
    return out, permuted_probs, sorted_


def routing_of(sorted_indices: torch.Tensor) -> Routing | None:
    """The Routing that `permute` attached to its sorted indices (None for megatron's own)."""
    return getattr(sorted_indices, "_offpolicy_routing", None)


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None = None
              ) -> torch.Tensor:
    """megatron's unfused `unpermute` of `permute`'s rows: [N, H], each token's copies summed (weighted by
    `probs` [N, E] if given)."""
    r = routing_of(sorted_indices)
    if r is None:
        raise ValueError("unpermute: these sorted indices were not made by permutation.permute")
    if probs is None:
        return _Unpermute.apply(permuted, sorted_indices, r)
    return _UnpermuteWeighted.apply(permuted, probs, sorted_indices, r)


# -- megatron-core's dispatcher module ------------------------------------------------------------------

_PLAIN: dict[str, object] = {}
_STATE = {"topk": 0, "five": -1}  # the top-k bound of the models installed for; permute returns 5 (1) or 3 (0)


def _host_int(n) -> int | None:
    """`num_out_tokens` as a Python int when the host knows it (int, numpy or CPU tensor), else None."""
    if n is None or (torch.is_tensor(n) and n.device.type != "cpu"):
        return None
    return int(n)


def megatron_permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
                     tokens_per_expert=None, align_size=0):
    """moe_utils.permute's signature (0.16: 3 results; 0.19: 5); `permute` where it applies."""
    num_out = _host_int(num_out_tokens)
    if fused or drop_and_pad or align_size or num_out is None or not _STATE["topk"]:
        extra = dict(tokens_per_expert=tokens_per_expert, align_size=align_size) if _five() else {}
        return _PLAIN["permute"](tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                 drop_and_pad=drop_and_pad, **extra)
    out, permuted_probs, sorted_ = permute(tokens, routing_map, num_out, _STATE["topk"], probs)
    return (out, permuted_probs, sorted_, None, tokens_per_expert) if _five() else (out, permuted_probs, sorted_)


def megatron_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                       drop_and_pad=False, pad_offsets=None):
    """moe_utils.unpermute's signature (0.19 adds `pad_offsets`); `unpermute` of `permute`'s rows."""
    r = routing_of(sorted_indices)
    if fused or drop_and_pad or pad_offsets is not None or r is None or restore_shape[0] != r.tokens:
        extra = dict(pad_offsets=pad_offsets) if pad_offsets is not None else {}
        return _PLAIN["unpermute"](permuted_tokens, sorted_indices, restore_shape, probs=probs,
                                   routing_map=routing_map, fused=fused, drop_and_pad=drop_and_pad, **extra)
    return unpermute(permuted_tokens, sorted_indices, probs)


def megatron_sort_chunks(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """moe_utils.sort_chunks_by_idxs: the input itself when the chunk order is the identity, else megatron's."""
    if not fused and not (torch.is_tensor(sorted_idxs) and sorted_idxs.device.type != "cpu"):
        order = torch.as_tensor(sorted_idxs)
        if torch.equal(order, torch.arange(order.numel(), dtype=order.dtype)):
            return input, probs
    return _PLAIN["sort_chunks_by_idxs"](input, split_sizes, sorted_idxs, probs=probs, fused=fused)


def _five() -> bool:
    """Whether this megatron-core's permute returns 5 values (0.19: pad offsets, tokens per expert)."""
    if _STATE["five"] < 0:
        _STATE["five"] = int("tokens_per_expert" in inspect.signature(_PLAIN["permute"]).parameters)
    return bool(_STATE["five"])


_OURS = {"permute": megatron_permute, "unpermute": megatron_unpermute, "sort_chunks_by_idxs": megatron_sort_chunks}


def install(mode: str, tconfig=None) -> None:
    """Make megatron-core's token dispatchers use `mode`'s permutation ("gather": this module's, "megatron":
    moe_utils' own) from now on in this process. `tconfig` (a MoE TransformerConfig) gives the top-k;
    with several models the largest (a bound is enough: tokens with fewer copies are padded)."""
    from megatron.core.transformer.moe import token_dispatcher

    if mode not in ("gather", "megatron"):
        raise ValueError(f"learner.megatron.moe_permute must be gather or megatron, not {mode!r}")
    for name in _OURS:
        _PLAIN.setdefault(name, getattr(token_dispatcher, name))
    if mode == "gather":
        if tconfig is not None:
            if getattr(tconfig, "moe_router_padding_for_quantization", False):
                raise ValueError("learner.megatron.moe_permute=gather: quantisation padding of the routing map "
                                 "gives tokens more than top-k copies; set moe_permute=megatron")
            _STATE["topk"] = max(_STATE["topk"], int(tconfig.moe_router_topk))
        for name, fn in _OURS.items():
            setattr(token_dispatcher, name, fn)
    else:
        for name, fn in _PLAIN.items():
            setattr(token_dispatcher, name, fn)
