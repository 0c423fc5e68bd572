"""Every estimator, aggregation, KL type and correction against plain float64 references.

References are written element by element with Python floats and `math`, independently of the
vectorised code; gradients are compared with autograd of element-wise torch references.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.config import load_config
from offpolicy.learner import algorithms as A
from offpolicy.learner.loss import policy_loss
from tests.conftest import QUICKSTART

D = torch.float64
REWARDS = [[1.0, 0.0, 0.5, 0.25], [0.0, 0.0, 1.0, 1.0]]


def mean(xs):
    return sum(xs) / len(xs)


def ref_advantages(rows, estimator, eps=1e-6):
    out = []
    for r in rows:
        n, m = len(r), mean(r)
        if estimator == "grpo":
            std = math.sqrt(sum((x - m) ** 2 for x in r) / (n - 1))
            out.append([(x - m) / (std + eps) for x in r])
        elif estimator == "grpo_no_std":
            out.append([x - m for x in r])
        else:
            out.append([x - (sum(r) - x) / (n - 1) for x in r])
    return out


@pytest.mark.parametrize("estimator", A.ADVANTAGES)
def test_advantages_match_the_reference(estimator):
    got = A.compute_advantages(torch.tensor(REWARDS, dtype=D), estimator)
    assert torch.allclose(got, torch.tensor(ref_advantages(REWARDS, estimator), dtype=D), atol=1e-12, rtol=0)


def test_advantages_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3)
    got = A.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=D), "grpo", eps=0.0)
    assert got[0, 0].item() == pytest.approx(0.5 / math.sqrt(1 / 3), abs=1e-12)
    # rloo of [1, 0, 0, 1]: 1 - (0 + 0 + 1) / 3 = 2/3
    got = A.compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=D), "rloo")
    assert got[0, 0].item() == pytest.approx(2 / 3, abs=1e-12)


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="grpo_no_std"):
        A.compute_advantages(torch.zeros(1, 2), "ppo")


def test_zero_variance_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    assert A.zero_variance_groups(r).tolist() == [True, False, True]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-10, 10), min_size=4, max_size=4), min_size=1, max_size=5),
       st.sampled_from(["grpo", "rloo", "grpo_no_std"]))
def test_advantages_sum_to_zero_within_each_group(rows, estimator):
    adv = A.compute_advantages(torch.tensor(rows, dtype=D), estimator)
    assert torch.allclose(adv.sum(-1), torch.zeros(len(rows), dtype=D), atol=1e-9)


# -- aggregation -----------------------------------------------------------------------------------
VALUES = [[0.5, -1.0, 2.0, 7.0], [1.5, 0.25, 9.0, 9.0], [-0.5, 3.0, 1.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def ref_aggregate(values, mask, mode, norm_len):
    sums = [sum(v * m for v, m in zip(vr, mr)) for vr, mr in zip(values, mask)]
    counts = [sum(mr) for mr in mask]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(values)
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in zip(sums, counts)) / len(values)
    return sum(sums) / (len(values) * norm_len)


@pytest.mark.parametrize("mode", A.LOSS_AGG)
def test_aggregation_matches_the_reference(mode):
    got = A.aggregate(torch.tensor(VALUES, dtype=D), torch.tensor(MASK, dtype=D), mode, norm_len=6)
    assert got.item() == pytest.approx(ref_aggregate(VALUES, MASK, mode, 6), abs=1e-12)


def test_token_mean_by_hand():
    # masked sum 0.5 - 1 + 2 + 1.5 + 0.25 - 0.5 + 3 + 1 + 0 = 6.75 over 9 tokens
    got = A.aggregate(torch.tensor(VALUES, dtype=D), torch.tensor(MASK, dtype=D), "token-mean")
    assert got.item() == pytest.approx(6.75 / 9, abs=1e-12)


@pytest.mark.parametrize("mode", A.LOSS_AGG)
def test_micro_batches_add_up_to_the_batch(mode):
    v, m = torch.tensor(VALUES, dtype=D), torch.tensor(MASK, dtype=D)
    whole = A.aggregate(v, m, mode, norm_len=6)
    totals = dict(num_tokens=m.sum().item(), num_seqs=3, norm_len=6)
    parts = A.aggregate(v[:1], m[:1], mode, **totals) + A.aggregate(v[1:], m[1:], mode, **totals)
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(A.LOSS_AGG), st.lists(st.floats(-100, 100), min_size=8, max_size=8))
def test_padding_never_changes_the_loss(mode, junk):
    v, m = torch.tensor(VALUES, dtype=D), torch.tensor(MASK, dtype=D)
    noisy = v.clone()
    pad = m == 0
    noisy[pad] = torch.tensor(junk[: int(pad.sum())], dtype=D)
    assert A.aggregate(noisy, m, mode, norm_len=6).item() == A.aggregate(v, m, mode, norm_len=6).item()


# -- policy loss -----------------------------------------------------------------------------------
LOGP = [[-0.2, -1.5, -0.7], [-2.0, -0.1, -0.9]]
LOGP_OLD = [[-0.5, -1.4, -0.2], [-1.2, -0.1, -2.5]]
ADV = [1.3, -0.8]


def ref_pg(logp, old, adv, low, high, c):
    out = []
    for lr, orow, a in zip(logp, old, adv):
        row = []
        for lp, o in zip(lr, orow):
            ratio = math.exp(lp - o)
            loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
            if c > 1 and a < 0:
                loss = min(loss, -a * c)
            row.append(loss)
        out.append(row)
    return out


def torch_ref_pg(logp, old, adv, low, high, c):
    """Element-wise torch reference (for gradients)."""
    rows = []
    for i in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            ratio = torch.exp(logp[i, t] - old[i, t])
            loss = torch.maximum(-adv[i] * ratio, -adv[i] * torch.clamp(ratio, 1 - low, 1 + high))
            if c > 1 and adv[i] < 0:
                loss = torch.minimum(loss, -adv[i] * c)
            row.append(loss)
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("low, high, c", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.1, 0.3, 1.5), (0.2, 0.2, 3.0)])
@pytest.mark.parametrize("mode", A.LOSS_AGG)
def test_policy_loss_and_gradient_match_the_reference(low, high, c, mode):
    mask = [[1, 1, 0], [1, 1, 1]]
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    loss, _ = A.clipped_policy_loss(logp, torch.tensor(LOGP_OLD, dtype=D), torch.tensor(ADV, dtype=D),
                                    torch.tensor(mask, dtype=D), low, high, clip_c=c, agg=mode, norm_len=5)
    expected = ref_aggregate(ref_pg(LOGP, LOGP_OLD, ADV, low, high, c), mask, mode, 5)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    logp2 = torch.tensor(LOGP, dtype=D, requires_grad=True)
    ref = A.aggregate(torch_ref_pg(logp2, torch.tensor(LOGP_OLD, dtype=D), torch.tensor(ADV, dtype=D), low, high, c),
                      torch.tensor(mask, dtype=D), mode, norm_len=5)
    (ref_grad,) = torch.autograd.grad(ref, logp2)
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)


def test_dual_clip_by_hand():
    # A = -1, ratio = e^2 ~ 7.39: clipped loss max(7.39, 1.2) = 7.39, dual clip caps it at -A * 3 = 3
    logp, old = torch.tensor([[0.0]], dtype=D), torch.tensor([[-2.0]], dtype=D)
    loss, stats = A.clipped_policy_loss(logp, old, torch.tensor([-1.0], dtype=D), torch.ones(1, 1, dtype=D),
                                        0.2, 0.2, clip_c=3.0)
    assert loss.item() == pytest.approx(3.0, abs=1e-12)
    assert stats["clip_dual_tokens"].item() == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-0.15, 0.15), min_size=6, max_size=6), st.lists(st.floats(-3, 3), min_size=2, max_size=2))
def test_clipped_equals_unclipped_inside_the_band(log_ratios, adv):
    old = torch.tensor(LOGP_OLD, dtype=D)
    logp = old + torch.tensor(log_ratios, dtype=D).view(2, 3)  # |log ratio| < 0.15 -> ratio in (0.86, 1.17)
    a, m = torch.tensor(adv, dtype=D), torch.ones(2, 3, dtype=D)
    loss, stats = A.clipped_policy_loss(logp, old, a, m, 0.2, 0.2, clip_c=3.0)
    unclipped = (-(torch.exp(logp - old)) * a[:, None]).mean()
    assert loss.item() == pytest.approx(unclipped.item(), abs=1e-12)
    assert stats["clip_low_tokens"] == 0 and stats["clip_high_tokens"] == 0


# -- KL --------------------------------------------------------------------------------------------
def ref_kl(lp, ref, kind):
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    d = min(max(ref - lp, -20), 20)
    return min(max(math.exp(d) - d - 1, -10), 10)


@pytest.mark.parametrize("kind", A.KL_TYPES)
def test_kl_matches_the_reference_and_its_gradient(kind):
    ref = [[-0.4, -1.0, -3.0], [-0.3, -0.2, -25.0]]
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    got = A.kl_penalty(logp, torch.tensor(ref, dtype=D), kind)
    expected = [[ref_kl(a, b, kind) for a, b in zip(r1, r2)] for r1, r2 in zip(LOGP, ref)]
    assert torch.allclose(got, torch.tensor(expected, dtype=D), atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(got.sum(), logp)
    # d/dlogp: k1 -> 1; k2 -> logp - ref; k3 -> 1 - exp(ref - logp) inside the clamps, 0 outside
    for i in range(2):
        for t in range(3):
            lp, rf = LOGP[i][t], ref[i][t]
            d = rf - lp
            want = {"k1": 1.0, "k2": lp - rf,
                    "low_var_kl": (1 - math.exp(d)) if -20 < d < 20 and abs(math.exp(d) - d - 1) < 10 else 0.0}[kind]
            assert grad[i, t].item() == pytest.approx(want, abs=1e-12)


def test_kl_is_zero_at_the_reference():
    lp = torch.tensor(LOGP, dtype=D)
    for kind in A.KL_TYPES:
        assert A.kl_penalty(lp, lp, kind).abs().max().item() == 0.0


# -- corrections -----------------------------------------------------------------------------------
def test_token_tis_by_hand():
    learner, rollout = torch.tensor([[-0.1, -2.0]], dtype=D), torch.tensor([[-0.5, -0.5]], dtype=D)
    w = A.truncated_is_weights(learner, rollout, torch.ones(1, 2), "token", 1.2)
    assert w.tolist() == [[pytest.approx(min(math.exp(0.4), 1.2)), pytest.approx(math.exp(-1.5))]]


def test_sequence_tis_by_hand():
    learner, rollout = torch.tensor([[-0.1, -2.0, -9.0]], dtype=D), torch.tensor([[-0.5, -1.8, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)  # the padded token's huge difference must not count
    w = A.truncated_is_weights(learner, rollout, mask, "sequence", 2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.4 - 0.2)] * 3, abs=1e-12)


def test_icepop_mask_by_hand():
    learner = torch.tensor([[0.0, 0.0, 0.0]], dtype=D)
    rollout = torch.tensor([[math.log(0.4), math.log(1.0), math.log(0.6)]], dtype=D)  # ratios 2.5, 1, 1.67
    assert A.icepop_mask(learner, rollout, 0.5, 2.0).tolist() == [[False, True, True]]


def _algo(*overrides):
    return load_config(QUICKSTART, list(overrides)).algo


def test_full_loss_with_kl_entropy_tis_icepop_matches_a_manual_composition():
    algo = _algo("algo.logp_old=recompute", "algo.tis=token", "algo.tis_threshold=1.5", "algo.icepop=true",
                 "algo.icepop_low=0.8", "algo.icepop_high=1.25", "algo.kl_loss_coef=0.1", "algo.kl_loss_type=k2",
                 "algo.entropy_coef=0.01", "algo.clip_ratio_c=3.0")
    logp = torch.tensor(LOGP, dtype=D, requires_grad=True)
    rollout = torch.tensor(LOGP_OLD, dtype=D)
    ref_logp = torch.tensor([[-0.3, -1.0, -0.5], [-1.0, -0.3, -1.0]], dtype=D)
    ent = torch.tensor([[0.5, 0.6, 0.7], [0.8, 0.9, 1.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    adv = torch.tensor(ADV, dtype=D)
    loss, stats = policy_loss(logp, rollout, adv, mask, algo, num_tokens=5, num_seqs=2, norm_len=3,
                              entropy=ent, ref_logp=ref_logp)
    # manual: ratio = 1 (recompute), so l = -A * w on tokens inside the icepop band
    total = 0.0
    for i in range(2):
        for t in range(3):
            if not mask[i, t]:
                continue
            r = math.exp(LOGP[i][t] - LOGP_OLD[i][t])
            w = min(r, 1.5)
            inside = 0.8 <= r <= 1.25
            if not inside:  # icepop-masked: no policy loss, KL or entropy; the denominator stays 5 tokens
                continue
            total += -ADV[i] * w / 5
            total += 0.1 * 0.5 * (LOGP[i][t] - ref_logp[i, t].item()) ** 2 / 5
            total -= 0.01 * ent[i, t].item() / 5
    assert loss.item() == pytest.approx(total, abs=1e-12)
    assert stats["icepop_masked_tokens"].item() == sum(
        1 for i in range(2) for t in range(3) if mask[i, t] and not 0.8 <= math.exp(LOGP[i][t] - LOGP_OLD[i][t]) <= 1.25)


def test_tis_without_recompute_is_refused_with_the_fix():
    from offpolicy.config import ConfigError

    with pytest.raises(ConfigError, match="algo.logp_old=recompute"):
        _algo("algo.tis=token")


def test_full_loss_gradient_matches_autograd_of_an_element_wise_reference():
    algo = _algo("algo.logp_old=recompute", "algo.tis=sequence", "algo.tis_threshold=1.5", "algo.kl_loss_coef=0.2",
                 "algo.kl_loss_type=low_var_kl", "algo.entropy_coef=0.05", "algo.loss_agg=seq-mean-token-mean")
    rollout, ref_logp = torch.tensor(LOGP_OLD, dtype=D), torch.tensor([[-0.3, -1.0, -0.5], [-1.0, -0.3, -1.0]], dtype=D)
    mask, adv = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D), torch.tensor(ADV, dtype=D)
    logits = torch.tensor([[[0.1, 0.5, -0.3], [1.0, 0.2, 0.0], [0.3, 0.3, 0.9]],
                           [[-0.5, 0.4, 0.1], [0.0, 0.0, 2.0], [1.5, -1.0, 0.2]]], dtype=D, requires_grad=True)
    tokens = torch.tensor([[0, 1, 2], [1, 2, 0]])

    def ours(lg):
        logp = A.token_logprobs(lg, tokens)
        loss, _ = policy_loss(logp, rollout, adv, mask, algo, num_tokens=5, num_seqs=2, norm_len=3,
                              entropy=A.token_entropy(lg), ref_logp=ref_logp)
        return loss

    def reference(lg):
        total = torch.zeros((), dtype=D)
        for i in range(2):
            n_i = int(mask[i].sum())
            lp_i = [torch.log_softmax(lg[i, t], -1)[tokens[i, t]] for t in range(n_i)]
            w = min(math.exp(sum(lp_i[t].item() - LOGP_OLD[i][t] for t in range(n_i))), 1.5)
            seq = torch.zeros((), dtype=D)
            for t in range(n_i):
                ratio = torch.exp(lp_i[t] - lp_i[t].detach())
                pg = torch.maximum(-adv[i] * ratio, -adv[i] * torch.clamp(ratio, 0.8, 1.2)) * w
                d = ref_logp[i, t] - lp_i[t]
                kl = torch.exp(d) - d - 1
                p = torch.softmax(lg[i, t], -1)
                ent = -(p * torch.log(p)).sum()
                seq = seq + pg + 0.2 * kl - 0.05 * ent
            total = total + seq / n_i
        return total / 2

    (g_ours,) = torch.autograd.grad(ours(logits), logits)
    (g_ref,) = torch.autograd.grad(reference(logits), logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-12, rtol=0)
