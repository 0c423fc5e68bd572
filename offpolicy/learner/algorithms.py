"""GRPO math as pure functions of tensors: advantages, logprobs, policy loss, KL, IS corrections.

Shapes: a group is one prompt's `n` responses; responses are right-padded to `[B, T]` with a 0/1
`mask` over real response tokens. No function here touches a model, a socket or a config object;
`docs/algorithm.md` gives every formula with its config name and default.

Micro-batching: every aggregation takes the whole batch's denominators (`num_tokens`, `num_seqs`),
so the sum of the micro-batch losses is exactly the loss of the whole batch.
"""

from __future__ import annotations

import torch

ADVANTAGES = ("grpo", "grpo_no_std", "rloo")
LOG_RATIO_BOUND = 20.0  # |logp - logp_old| is clamped to this before exp (as verl): e^20 = 4.9e8, finite in float32
LOSS_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "low_var_kl")


# -- advantages ----------------------------------------------------------------------------------
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) for rewards `[G, n]`; std is unbiased (as torch.std, verl)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


def compute_advantages(rewards: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages `[G, n]` from rewards `[G, n]`.

    grpo:        (r_i - mean) / (std + eps)
    grpo_no_std: r_i - mean                               (Dr. GRPO)
    rloo:        r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean)   (leave-one-out baseline)
    """
    if estimator == "grpo":
        return grpo_advantages(rewards, eps)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if estimator == "grpo_no_std":
        return centred
    if estimator == "rloo":
        n = rewards.shape[-1]
        return centred * (n / (n - 1))
    raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {ADVANTAGES}")


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool `[G]`: groups whose responses all got the same reward (no learning signal; DAPO filters them)."""
    return (rewards == rewards[..., :1]).all(dim=-1)


# -- logprobs ------------------------------------------------------------------------------------
def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least float32 (float64 stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `tokens`: `[B, T, V]`, `[B, T]` -> `[B, T]`."""
    logp = torch.log_softmax(_wide(logits) / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: `[B, T, V]` -> `[B, T]`."""
    logp = torch.log_softmax(_wide(logits) / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# -- aggregation ---------------------------------------------------------------------------------
def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
              num_tokens: float | None = None, num_seqs: float | None = None,
              norm_len: float | None = None) -> torch.Tensor:
    """Reduce per-token `values` `[B, T]` over `mask` to a scalar.

    token-mean:              sum_i,t v m / N_tokens
    seq-mean-token-sum:      sum_i (sum_t v m) / N_seqs
    seq-mean-token-mean:     sum_i (sum_t v m / sum_t m) / N_seqs
    seq-mean-token-sum-norm: sum_i,t v m / (N_seqs * norm_len)        (Dr. GRPO; norm_len = max length)
    N_tokens, N_seqs default to this tensor's own counts; pass the whole batch's for micro-batches.
    A masked position contributes exactly 0 whatever it holds (inf and NaN included): it is selected
    away, never multiplied by 0. A row with no unmasked token adds 0 and still counts in N_seqs.
    """
    mask = mask.to(values.dtype)
    masked = torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))
    n_tok = mask.sum().clamp(min=1) if num_tokens is None else torch.as_tensor(num_tokens, dtype=values.dtype)
    n_seq = torch.as_tensor(values.shape[0] if num_seqs is None else num_seqs, dtype=values.dtype)
    if mode == "token-mean":
        return masked.sum() / n_tok
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        length = values.shape[-1] if norm_len is None else norm_len
        return masked.sum() / (n_seq * length)
    raise ValueError(f"unknown loss aggregation {mode!r}: use one of {LOSS_AGG}")


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest of the non-negative `values` where `mask` != 0 (masked positions are selected away, whatever
    they hold), 0 where none is: a device scalar, no host synchronisation (a branch on `mask.any()` waits for
    the GPU to finish everything queued before it, leaving it idle between forward and backward)."""
    if values.numel() == 0:
        return values.new_zeros(())
    return torch.where(mask != 0, values, 0).amax()


# -- policy loss ---------------------------------------------------------------------------------
def clipped_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float, clip_high: float,
                        num_tokens: float | None = None, *, clip_c: float = 0.0, agg: str = "token-mean",
                        num_seqs: float | None = None, norm_len: float | None = None,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate with optional dual clip and importance weights.

    ratio = exp(clamp(logp - logp_old, -20, 20))    (LOG_RATIO_BOUND, as verl: finite at any input)
    l     = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    dual clip (clip_c > 1, only where A < 0): l = min(l, -A * clip_c)
    l     = l * weights (truncated IS weights, detached), then aggregated by `agg` over `mask`.
    `advantages` is `[B]` (one per response) or `[B, T]`. Returns the loss and detached masked sums
    of clip events, ratio and approximate KL (k1, logp_old - logp) for the caller to reduce.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    fmask = mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - logp_old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(fmask, dtype=torch.bool)
    if clip_c > 1.0:
        cap = -adv * clip_c
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, fmask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        stats = {
            "tokens": fmask.sum(),
            "clip_low_tokens": (((ratio < 1 - clip_low) & (adv < 0)).to(fmask.dtype) * fmask).sum(),
            "clip_high_tokens": (((ratio > 1 + clip_high) & (adv > 0)).to(fmask.dtype) * fmask).sum(),
            "clip_dual_tokens": (dual.to(fmask.dtype) * fmask).sum(),
            "ratio_sum": aggregate(ratio, fmask, "seq-mean-token-sum", num_seqs=1),
            "ratio_max": masked_max(ratio, fmask),
            "kl_sum": aggregate(-log_ratio, fmask, "seq-mean-token-sum", num_seqs=1),
        }
    return loss, stats


# -- KL to a reference policy --------------------------------------------------------------------
def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference.

    k1:         logp - ref_logp
    k2:         0.5 * (logp - ref_logp)^2                                  ("mse")
    low_var_kl: k3 = exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20] and
                k3 to [-10, 10]                                            (Schulman's k3, as verl)
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        kl = torch.clamp(ref_logp - logp, -20, 20)
        return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    raise ValueError(f"unknown kl_loss_type {kind!r}: use one of {KL_TYPES}")


# -- rollout/learner mismatch corrections --------------------------------------------------------
def truncated_is_weights(logp_learner: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                         level: str, threshold: float) -> torch.Tensor:
    """Truncated importance weights pi_learner / pi_rollout, detached, `[B, T]`.

    token:    w_t = min(exp(logp_learner_t - logp_rollout_t), threshold)
    sequence: w   = min(exp(sum_t (logp_learner_t - logp_rollout_t)), threshold), on every token
    Masked positions add nothing to the sequence sum, whatever they hold.
    """
    diff = torch.where(mask != 0, (logp_learner - logp_rollout).detach(), torch.zeros((), dtype=logp_learner.dtype,
                                                                                      device=logp_learner.device))
    if level == "token":
        return torch.clamp(torch.exp(diff), max=threshold)
    if level == "sequence":
        w = torch.clamp(torch.exp(diff.sum(-1, keepdim=True)), max=threshold)
        return w.expand_as(diff)
    raise ValueError(f"unknown TIS level {level!r}: use 'token' or 'sequence'")


def icepop_mask(logp_learner: torch.Tensor, logp_rollout: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Bool `[B, T]`: tokens whose ratio pi_learner / pi_rollout lies inside [low, high] (others are masked)."""
    ratio = torch.exp((logp_learner - logp_rollout).detach())
    return (ratio >= low) & (ratio <= high)
