"""The GRPO loss of one micro-batch, composed from the pure functions of `algorithms`, and the step's
statistics reduced from the micro-batches' sums. Every learner backend (torch, Megatron) applies this
same loss to its own logprobs, so the algorithm lives here once (docs/algorithm.md gives each term).

`policy_loss` picks the ratio's denominator (`algo.logp_old`), weighs tokens by truncated importance
sampling (`algo.tis`), masks them by icepop, adds the KL to a reference and the entropy bonus; every
term uses the whole batch's denominators (`num_tokens`, `num_seqs`, `norm_len`), so the micro-batch
losses sum to the batch's. It returns the loss and masked sums; `step_report` turns a step's sums into
the per-step statistics (clip fractions, ratio, KL, entropy, logprob gaps).
"""

from __future__ import annotations

import torch

from offpolicy.config import AlgoConfig
from offpolicy.learner import algorithms


def policy_loss(logp: torch.Tensor, logp_rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                algo: AlgoConfig, *, num_tokens: float, num_seqs: float, norm_len: float,
                entropy: torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full GRPO loss of one micro-batch (see docs/algorithm.md); returns loss and masked sums."""
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    logp_learner = logp.detach()
    logp_old = logp_learner if algo.logp_old == "recompute" else logp_rollout
    fmask = mask.to(logp.dtype)
    stats: dict[str, torch.Tensor] = {}
    weights = None
    if algo.tis != "none":
        weights = algorithms.truncated_is_weights(logp_learner, logp_rollout, mask, algo.tis, algo.tis_threshold)
        stats["tis_weight_sum"] = (weights * fmask).sum()
        stats["tis_truncated_tokens"] = ((weights >= algo.tis_threshold).to(fmask.dtype) * fmask).sum()
    loss_mask = fmask
    if algo.icepop:
        inside = algorithms.icepop_mask(logp_learner, logp_rollout, algo.icepop_low, algo.icepop_high)
        loss_mask = fmask * inside.to(fmask.dtype)
        stats["icepop_masked_tokens"] = fmask.sum() - loss_mask.sum()
    loss, pg = algorithms.clipped_policy_loss(logp, logp_old, adv, loss_mask, algo.clip_ratio_low,
                                              algo.clip_ratio_high, clip_c=algo.clip_ratio_c, agg=algo.loss_agg,
                                              weights=weights, **agg)
    stats.update(pg)
    stats["tokens"] = fmask.sum()
    stats["pg_loss"] = loss.detach()
    # KL and entropy on the tokens the policy loss sees: icepop-masked ones get neither (as verl, which
    # removes them from its response mask); the denominators stay the batch's response tokens (docs/algorithm.md)
    if ref_logp is not None:
        kl = algorithms.aggregate(algorithms.kl_penalty(logp, ref_logp, algo.kl_loss_type), loss_mask,
                                  algo.loss_agg, **agg)
        loss = loss + algo.kl_loss_coef * kl
        stats["kl_loss"] = kl.detach()
    if entropy is not None:
        ent = algorithms.aggregate(entropy, loss_mask, algo.loss_agg, **agg)
        loss = loss - algo.entropy_coef * ent
    with torch.no_grad():
        diff = (logp_learner - logp_rollout).abs()
        stats["logprob_diff_sum"] = (diff * fmask).sum()
        stats["logprob_diff_max"] = algorithms.masked_max(diff, fmask)
    return loss, stats


def step_report(sums: dict[str, float], maxes: dict[str, float], grad_norm: float) -> dict[str, float]:
    """A step's statistics (the backend's `train_step` result, less its own timings) from the sums and
    maxima of its micro-batches' `policy_loss` stats and the global grad norm."""
    n = max(sums["tokens"], 1.0)
    out = {
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss"],
        "grad_norm": grad_norm,
        "clip_frac_low": sums["clip_low_tokens"] / n,
        "clip_frac_high": sums["clip_high_tokens"] / n,
        "clip_frac_dual": sums["clip_dual_tokens"] / n,
        "clip_frac": (sums["clip_low_tokens"] + sums["clip_high_tokens"]) / n,
        "ratio_mean": sums["ratio_sum"] / n,
        "ratio_max": maxes["ratio_max"],
        "approx_kl": sums["kl_sum"] / n,
        "entropy": sums["entropy_sum"] / n,
        "logprob_diff_mean": sums["logprob_diff_sum"] / n,
        "logprob_diff_max": maxes["logprob_diff_max"],
    }
    if "kl_loss" in sums:
        out["kl_loss"] = sums["kl_loss"]
    if "tis_weight_sum" in sums:
        out["tis_weight_mean"] = sums["tis_weight_sum"] / n
        out["tis_truncated_frac"] = sums["tis_truncated_tokens"] / n
    if "icepop_masked_tokens" in sums:
        out["icepop_masked_frac"] = sums["icepop_masked_tokens"] / n
    return out
