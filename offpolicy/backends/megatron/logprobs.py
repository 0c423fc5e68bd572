"""Per-token logprobs and entropy from vocabulary-sharded logits, never gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice [lo, hi) of the (padded) vocabulary. With
z = logits / temperature (float32), padded columns (>= the true vocabulary) set to -inf:
  m      = max over the full vocabulary       (all-reduce MAX; a constant for autograd)
  lse    = m + log(sum_r sum_v exp(z - m))    (all-reduce SUM of one number per position)
  logp   = z[token] - lse                     (the owning rank contributes z[token], others 0)
  H      = lse - sum_v softmax(z)_v z_v       (all-reduce SUM)
The sums go through Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward,
identity backward), which is the right gradient because every TP rank computes the same loss.
With tp = 1 these are exactly `algorithms.token_logprobs` / `token_entropy`.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, *, vocab_size: int,
                            tp_rank: int, tp_group, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp `[B, T]`, entropy `[B, T]` or None) from local logits `[B, T, V/tp]` and `tokens` `[B, T]`."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_sum

    part = logits.shape[-1]
    lo = tp_rank * part
    z = logits.float() / temperature
    if lo + part > vocab_size:  # padded columns of the last shard
        cols = torch.arange(lo, lo + part, device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    m = z.detach().amax(dim=-1)
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - m.unsqueeze(-1)
    sumexp = shifted.exp().sum(-1)
    local = tokens - lo
    own = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * own
    if tp > 1:
        sumexp, picked = reduce_sum(sumexp), reduce_sum(picked)
    log_sumexp = sumexp.log()
    logp = picked - log_sumexp
    if not with_entropy:
        return logp, None
    probs = (shifted - log_sumexp.unsqueeze(-1)).exp()
    expected = (probs * shifted.masked_fill(torch.isinf(shifted), 0.0)).sum(-1)
    if tp > 1:
        expected = reduce_sum(expected)
    return logp, log_sumexp - expected
