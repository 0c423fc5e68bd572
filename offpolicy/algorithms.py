"""GRPO math as pure functions of tensors: advantages, token logprobs, the clipped-ratio loss.

Shapes: a group is one prompt's `n` responses; responses are right-padded to `[B, T]` with a 0/1
`mask` over real response tokens. No function here touches a model, a socket or a config object.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) for rewards `[G, n]`; std is unbiased (as torch.std, verl)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `tokens`: `[B, T, V]`, `[B, T]` -> `[B, T]` (float32)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: `[B, T, V]` -> `[B, T]`."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def clipped_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float, clip_high: float,
                        num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate, token-mean aggregated.

    ratio = exp(logp - logp_old); per token loss = -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A);
    loss = sum(loss * mask) / num_tokens, where `num_tokens` defaults to mask.sum() (pass the whole
    batch's count when accumulating micro-batches, so the sum of micro losses is the batch loss).
    `advantages` is `[B]` (one per response) or `[B, T]`. Returns the loss and detached statistics:
    masked sums of clip events, ratio and approximate KL (k1, logp_old - logp), for the caller to
    reduce over the batch.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    mask = mask.to(logp.dtype)
    n = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logp.dtype)
    log_ratio = logp - logp_old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = (per_token * mask).sum() / n.clamp(min=1)
    with torch.no_grad():
        stats = {
            "tokens": mask.sum(),
            "clip_low_tokens": (((ratio < 1 - clip_low) & (adv < 0)).to(mask.dtype) * mask).sum(),
            "clip_high_tokens": (((ratio > 1 + clip_high) & (adv > 0)).to(mask.dtype) * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "ratio_max": (ratio * mask).max() if mask.any() else torch.zeros(()),
            "kl_sum": (-log_ratio * mask).sum(),
        }
    return loss, stats
