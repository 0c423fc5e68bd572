"""Per-token logprobs and entropy straight from hidden states, in vocabulary chunks, never all logits at once.

Each tensor-parallel rank holds the output weight's rows [lo, hi) of the (padded) vocabulary. For the
N response positions of a micro-batch, hidden `[N, h]` and weight `[V/tp, h]`, with
z = (hidden @ weight^T) / temperature (the matmul in the model dtype, then float32, as the output layer
and a float32 log-softmax would compute it; padded rows >= the true vocabulary are skipped):
  m      = max over the vocabulary                          (online over chunks, all-reduce MAX)
  lse    = m + log(sum_v exp(z_v - m))                      (all-reduce SUM of one number per token)
  logp   = z[token] - lse                                   (the owning rank contributes z[token])
  H      = lse - sum_v p_v z_v,  p = exp(z - lse)           (all-reduce SUM)
Only a `[N, chunk]` float32 block of z exists at a time (`chunk` columns from a byte budget); the
backward recomputes each block: dz_v = g_logp (1[v = token] - p_v) - g_H p_v (z_v - E_p[z]), then
grad_weight[chunk] = dz^T hidden in one matmul per chunk (exact, no accumulation over chunks) and
grad_hidden = sum over chunks of dz weight[chunk] (float32). The caller puts `hidden` into the TP region
(copy_to / gather_from_sequence_parallel_region: the backward's partial grad_hidden is summed over TP).
With tp = 1 these are `algorithms.token_logprobs` / `token_entropy` of the full logits.
On a GPU (`triton_runs`: moe_triton.available, not float64) the elementwise steps are two Triton kernels
(logprob_kernels.py): `chunk_stats` folds a block into each row's running (m, sum exp, sum exp z, z[token])
state [4, N] in place, tiles of STATS_TILE rows x columns online, one read of the block; `chunk_grad` writes dz
over the block it read (tiles of GRAD_TILE), and grad_hidden's float32 sums take moe_triton.accumulate.
Elsewhere they are plain functions (`chunk_stats`, `chunk_grad`) that `compiled(True)` hands to torch.compile:
fused, each block of logits is read once instead of a dozen float32 passes (inductor's kernels index the
dynamic-width block with 64-bit divisions: several times their bytes' time on a GPU, docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from offpolicy.learner.backends.megatron.kernels import moe_triton


def chunk_stats(logits: torch.Tensor, temperature: float):
    """(max, sum exp(z - max), sum exp(z - max) z) per row of z = logits / temperature, in float32."""
    z = logits.to(_wide(logits.dtype)) / temperature
    m = z.amax(dim=-1)
    e = torch.exp(z - m[:, None])
    return m, e.sum(-1), (e * z).sum(-1)


def chunk_grad(logits, temperature: float, lse, mean_z, g_logp, g_ent, local) -> torch.Tensor:
    """d loss / d logits of one chunk in the logits' dtype; `local` = each row's token column (or -1)."""
    z = logits.to(_wide(logits.dtype)) / temperature
    p = torch.exp(z - lse[:, None])
    cols = torch.arange(z.shape[1], device=z.device)
    dz = torch.where(cols[None, :] == local[:, None], g_logp[:, None], 0.0) - p * g_logp[:, None]
    dz = dz - g_ent[:, None] * p * (z - mean_z[:, None])
    return (dz / temperature).to(logits.dtype)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (the tests' reference precision)."""
    return torch.promote_types(dtype, torch.float32)


_FNS = {False: (chunk_stats, chunk_grad)}


def compiled(on: bool):
    """(chunk_stats, chunk_grad), through torch.compile when `on` (compiled once, dynamic shapes)."""
    if on not in _FNS:
        _FNS[on] = tuple(torch.compile(f, dynamic=True) for f in (chunk_stats, chunk_grad))
    return _FNS[on]


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float, *,
                  vocab_size: int, tp_rank: int = 0, tp_group=None, chunk_bytes: int = 1 << 30,
                  compile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp `[N]`, entropy `[N]`) float32 of `tokens` `[N]` under softmax(hidden @ weight^T / temperature)."""
    return _Head.apply(hidden, weight, tokens, temperature, vocab_size, tp_rank, tp_group, chunk_bytes, compile)


def _chunks(rows: int, cols: int, chunk_bytes: int) -> list[tuple[int, int]]:
    width = max(128, chunk_bytes // (4 * max(rows, 1)) // 128 * 128)
    return [(c, min(cols, c + width)) for c in range(0, cols, width)]


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, vocab_size, tp_rank, tp_group, chunk_bytes, compile):
        stats, _ = compiled(compile)
        n, part = hidden.shape[0], weight.shape[0]
        lo = tp_rank * part
        valid = max(0, min(part, vocab_size - lo))
        local = tokens - lo
        fast = triton_runs(hidden)
        # running max m, sum exp(z - m), sum exp(z - m) z, z[token]
        state = torch.zeros(4, n, dtype=_wide(hidden.dtype), device=hidden.device)
        state[0] = float("-inf")
        sums = state[1:]
        for c0, c1 in _chunks(n, valid, chunk_bytes):
            logits = hidden @ weight[c0:c1].t()
            if fast:
                _fold_triton(logits, state, local, c0, temperature)
                continue
            m = state[0]
            mc, sc, zc = stats(logits, temperature)
            new = torch.maximum(m, mc)
            old_w, new_w = torch.exp(m - new), torch.exp(mc - new)
            sums[0] = sums[0] * old_w + sc * new_w
            sums[1] = sums[1] * old_w + zc * new_w
            mine = (local >= c0) & (local < c1)
            at = (local - c0).clamp(0, c1 - c0 - 1)
            sums[2] += torch.where(mine, logits.gather(1, at[:, None])[:, 0].to(state.dtype) / temperature, 0.0)
            state[0] = new
        m = state[0]
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            top = m.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
            scale = torch.exp(m - top)  # a rank with no columns has m = -inf and sums 0
            sums[:2] *= torch.where(torch.isfinite(m), scale, 0.0)
            dist.all_reduce(sums, group=tp_group)
            m = top
        lse = m + sums[0].log()
        mean_z = sums[1] / sums[0]
        ctx.save_for_backward(hidden, weight, local, lse, mean_z)
        ctx.args = (temperature, valid, chunk_bytes, compile, fast)
        ctx.set_materialize_grads(False)
        return sums[2] - lse, lse - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local, lse, mean_z = ctx.saved_tensors
        temperature, valid, chunk_bytes, compile, fast = ctx.args
        _, grad_fn = compiled(compile)
        zeros = torch.zeros_like(lse)
        g_logp = zeros if g_logp is None else g_logp.to(lse.dtype).contiguous()
        g_ent = zeros if g_ent is None else g_ent.to(lse.dtype).contiguous()
        grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        grad_weight[valid:].zero_()  # padded vocabulary rows get no gradient
        for c0, c1 in _chunks(hidden.shape[0], valid, chunk_bytes):
            w = weight[c0:c1]
            if fast:  # the logits' block becomes its gradient in place; its product added by one float32 pass
                dz = _grad_triton(hidden @ w.t(), lse, mean_z, g_logp, g_ent, local, c0, temperature)
                moe_triton.accumulate(grad_hidden, dz @ w)
            else:
                dz = grad_fn(hidden @ w.t(), temperature, lse, mean_z, g_logp, g_ent,
                             torch.where((local >= c0) & (local < c1), local - c0, -1))
                grad_hidden += dz @ w
            torch.mm(dz.t(), hidden, out=grad_weight[c0:c1])
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None


STATS_TILE = (8, 256)  # Triton chunk_stats: rows x columns a loop step (a program loops over the chunk's columns)
GRAD_TILE = (8, 512)  # Triton chunk_grad: rows x columns a program


def triton_runs(hidden: torch.Tensor) -> bool:
    """Whether the chunks' elementwise passes run as the Triton kernels (logprob_kernels.py): where the learner's
    kernels run (moe_triton.available) and hidden is not float64 (the tests' reference precision)."""
    return hidden.dtype != torch.float64 and moe_triton.available(hidden)


def _fold_triton(logits: torch.Tensor, state: torch.Tensor, local: torch.Tensor, c0: int, temperature: float):
    n, c = logits.shape
    if n and c:
        br, bc = STATS_TILE
        _kernels().chunk_stats[(-(-n // br),)](logits, state, local, n, c, c0, float(temperature), BR=br, BC=bc,
                                               num_warps=4)


def _grad_triton(logits, lse, mean_z, g_logp, g_ent, local, c0: int, temperature: float) -> torch.Tensor:
    n, c = logits.shape
    if n and c:
        br, bc = GRAD_TILE
        _kernels().chunk_grad[(-(-n // br), -(-c // bc))](logits, lse, mean_z, g_logp, g_ent, local, n, c, c0,
                                                          float(temperature), BR=br, BC=bc, num_warps=4)
    return logits


@functools.cache
def _kernels():
    from offpolicy.learner.backends.megatron.kernels import logprob_kernels

    return logprob_kernels
