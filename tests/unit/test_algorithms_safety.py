"""The loss at any input (issue 26): log-ratios of +-100, inf/NaN at masked positions, icepop semantics.

The reference is a float64 transcription of verl's `compute_policy_loss_vanilla` and `agg_loss`
(verl/trainer/ppo/core_algos.py: log-ratio clamped to [-20, 20] before exp, dual clip where A < 0)
written element by element with Python floats and `math`, kept here, not the vectorised code again.
"""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.learner import algorithms as A
from offpolicy.learner.loss import policy_loss
from tests.conftest import QUICKSTART

EXTREME = [-100.0, -88.0, -30.0, -20.5, -19.0, -3.0, 0.0, 0.1, 3.0, 19.0, 20.5, 30.0, 88.0, 100.0]


def verl_token_loss(log_ratio: float, adv: float, low: float, high: float, c: float | None) -> float:
    """verl's per-token vanilla PPO loss, in Python floats (c None: no dual clip)."""
    ratio = math.exp(min(max(log_ratio, -20.0), 20.0))
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if c is not None and adv < 0:
        loss = min(-adv * c, loss)
    return loss


def verl_token_grad(log_ratio: float, adv: float, low: float, high: float, c: float | None) -> float:
    """d loss / d logp of `verl_token_loss` by hand: 0 outside the clamp, where a clip binds or the dual cap."""
    if not -20.0 < log_ratio < 20.0:
        return 0.0
    ratio = math.exp(log_ratio)
    clipped = min(max(ratio, 1 - low), 1 + high)
    if -adv * ratio < -adv * clipped:  # the clipped branch wins: constant in logp
        return 0.0
    if c is not None and adv < 0 and -adv * c < -adv * ratio:
        return 0.0
    return -adv * ratio


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c", [None, 3.0])
@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_extreme_log_ratios_give_verls_finite_loss_and_gradient(dtype, c, adv):
    x = torch.tensor([EXTREME], dtype=torch.float64)
    logp = x.clone().to(dtype).requires_grad_(True)  # logp_old = 0, so logp is the log-ratio
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, stats = A.clipped_policy_loss(logp, old, torch.tensor([adv], dtype=dtype), mask, 0.2, 0.28,
                                        clip_c=c or 0.0)
    loss.backward()
    n = len(EXTREME)
    want = sum(verl_token_loss(v, adv, 0.2, 0.28, c) for v in EXTREME) / n
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v).all() for v in stats.values())
    assert loss.item() == pytest.approx(want, rel=1e-6 if dtype == torch.float32 else 1e-12)
    for v, g in zip(EXTREME, logp.grad[0].tolist()):
        assert g == pytest.approx(verl_token_grad(v, adv, 0.2, 0.28, c) / n, rel=1e-5, abs=1e-30), v


@pytest.mark.parametrize("junk", [math.inf, -math.inf, math.nan, 1e30])
@pytest.mark.parametrize("mode", A.LOSS_AGG)
def test_a_masked_position_holding_anything_changes_nothing(junk, mode):
    """Padding may hold inf or NaN (e.g. a -inf rollout logprob): the loss and gradient are those without it."""
    logp = torch.tensor([[-0.3, -1.2, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.2, -1.0, junk], [-0.9, junk, junk]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([0.9, -1.1])
    loss, _ = A.clipped_policy_loss(logp, old, adv, mask, 0.2, 0.2, agg=mode, clip_c=3.0, norm_len=3)
    loss.backward()
    # verl's formula by hand on the three real tokens
    toks = [(-0.3 + 0.2, 0.9, 0), (-1.2 + 1.0, 0.9, 0), (-0.5 + 0.9, -1.1, 1)]
    per = [verl_token_loss(x, a, 0.2, 0.2, 3.0) for x, a, _ in toks]
    want = {"token-mean": sum(per) / 3, "seq-mean-token-sum": (per[0] + per[1] + per[2]) / 2,
            "seq-mean-token-mean": ((per[0] + per[1]) / 2 + per[2]) / 2,
            "seq-mean-token-sum-norm": sum(per) / (2 * 3)}[mode]
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0 and (logp.grad[1, 1:] == 0).all()
    values = torch.tensor([[1.0, 2.0, junk]])
    assert A.aggregate(values, torch.tensor([[1.0, 1.0, 0.0]]), mode, norm_len=3).item() == pytest.approx(
        {"token-mean": 1.5, "seq-mean-token-sum": 3.0, "seq-mean-token-mean": 1.5, "seq-mean-token-sum-norm": 1.0}[mode])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_at_extreme_mismatch_are_finite(level):
    learner = torch.tensor([[100.0, -100.0, 0.5, 0.0]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, -math.inf]])  # the last position is padding
    w = A.truncated_is_weights(learner, rollout, torch.tensor([[1, 1, 1, 0]]), level, 2.0)
    assert torch.isfinite(w).all()
    if level == "token":
        assert w[0, :3].tolist() == pytest.approx([2.0, 0.0, math.exp(0.5)])
    else:
        assert w[0].tolist() == pytest.approx([math.exp(0.5)] * 4)  # exp(100 - 100 + 0.5), under the cap
    inside = A.icepop_mask(learner, rollout, 0.5, 2.0)
    assert inside[0, :3].tolist() == [False, False, True]


def _algo(*overrides):
    return load_config(QUICKSTART, list(overrides)).algo


def test_icepop_masked_tokens_get_no_loss_kl_or_entropy_but_count_in_the_denominator():
    """The chosen semantics (docs/algorithm.md): an icepop-masked token contributes nothing (no policy loss, no KL,
    no entropy, as verl), the token-mean denominator stays the batch's response tokens (verl's shrinks)."""
    algo = _algo("algo.logp_old=recompute", "algo.icepop=true", "algo.icepop_low=0.5", "algo.icepop_high=2.0",
                 "algo.kl_loss_coef=0.1", "algo.kl_loss_type=k1", "algo.entropy_coef=0.01")
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-1.0, -1.0 - 100.0, -1.0 + 100.0]], dtype=torch.float64)  # two far outside the band
    ref = torch.tensor([[-1.5, -1.5, -1.5]], dtype=torch.float64)
    ent = torch.tensor([[0.4, 0.4, 0.4]], dtype=torch.float64)
    loss, stats = policy_loss(logp, rollout, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 3), algo,
                              num_tokens=3, num_seqs=1, norm_len=3, entropy=ent, ref_logp=ref)
    loss.backward()
    # by hand: only token 0 counts; recompute -> ratio 1, pg = -A = -2; k1 = logp - ref = 0.5; entropy 0.4; / 3 tokens
    assert loss.item() == pytest.approx((-2.0 + 0.1 * 0.5 - 0.01 * 0.4) / 3, abs=1e-12)
    assert stats["icepop_masked_tokens"].item() == 2
    assert logp.grad[0, 1:].tolist() == [0.0, 0.0] and torch.isfinite(logp.grad).all()


def test_a_fully_masked_row_counts_in_the_seq_mean_modes():
    """As verl's default (exclude_fully_masked_seq off): a response with no token left adds 0 to the sum and 1 to N_seqs."""
    v = torch.tensor([[2.0, 4.0], [8.0, 8.0]])
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert A.aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx(3.0 / 2)
    assert A.aggregate(v, m, "seq-mean-token-sum").item() == pytest.approx(6.0 / 2)
    assert A.aggregate(v, m, "token-mean").item() == pytest.approx(3.0)
