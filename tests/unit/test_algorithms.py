"""GRPO advantages, token logprobs / entropy and the clipped policy loss against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.learner.algorithms import clipped_policy_loss, grpo_advantages, token_entropy, token_logprobs

D = torch.float64
LOW, HIGH = 0.2, 0.28  # clip band [0.8, 1.28]


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


# -- advantages ------------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    # [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(((0.5^2) * 4) / 3) = sqrt(1/3); 0.5 / sqrt(1/3) = sqrt(3)/2
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    h = math.sqrt(3) / 2
    assert torch.allclose(adv, t([[h, -h, -h, h]]), atol=1e-12, rtol=0)


def test_grpo_advantages_default_eps_is_added_to_the_std():
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0]]))
    assert adv[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), abs=1e-12)


def test_grpo_advantages_normalise_each_group_on_its_own():
    # group 2: [2, 4, 6, 8], mean 5, unbiased var (9 + 1 + 1 + 9) / 3 = 20/3
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]]), eps=0.0)
    s = math.sqrt(20 / 3)
    h = math.sqrt(3) / 2
    expected = t([[h, -h, -h, h], [-3 / s, -1 / s, 1 / s, 3 / s]])
    assert torch.allclose(adv, expected, atol=1e-12, rtol=0)


def test_grpo_advantages_three_samples():
    # [2, 4, 6]: mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    adv = grpo_advantages(t([[2.0, 4.0, 6.0]]), eps=0.0)
    assert torch.allclose(adv, t([[-1.0, 0.0, 1.0]]), atol=1e-12, rtol=0)


def test_grpo_advantages_of_a_constant_group_are_zero_not_nan():
    adv = grpo_advantages(t([[0.7, 0.7, 0.7, 0.7], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 4, dtype=D))


def test_grpo_advantages_are_shift_and_scale_invariant():
    r = t([[0.1, 0.9, 0.4, 0.3, 0.8]])
    a = grpo_advantages(r, eps=0.0)
    b = grpo_advantages(3.0 * r - 7.0, eps=0.0)
    assert torch.allclose(a, b, atol=1e-12, rtol=0)


# -- token logprobs and entropy --------------------------------------------------------------------
def manual_log_softmax(row, temperature):
    z = [x / temperature for x in row]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


LOGITS = [[[1.0, 2.0, 3.0, -1.0], [0.5, 0.5, -2.0, 4.0]], [[-3.0, 0.0, 0.25, 1.0], [2.0, 2.0, 2.0, 2.0]]]
TOKENS = [[2, 0], [3, 1]]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0, 0.7])
def test_token_logprobs_match_manual_log_softmax(temperature):
    got = token_logprobs(t(LOGITS), torch.tensor(TOKENS), temperature)
    expected = [[manual_log_softmax(LOGITS[b][i], temperature)[TOKENS[b][i]] for i in range(2)] for b in range(2)]
    assert got.shape == (2, 2)
    assert torch.allclose(got, t(expected), atol=1e-12, rtol=0)


def test_token_logprobs_by_hand():
    # log softmax([1, 2, 3])[2] = -log(1 + e^-1 + e^-2); at T=2 the logits are [0.5, 1, 1.5]
    lp = token_logprobs(t([[[1.0, 2.0, 3.0]]]), torch.tensor([[2]]))
    assert lp.item() == pytest.approx(-math.log(1 + math.exp(-1) + math.exp(-2)), abs=1e-12)
    assert lp.item() == pytest.approx(-0.40760596444438, abs=1e-12)
    lp2 = token_logprobs(t([[[1.0, 2.0, 3.0]]]), torch.tensor([[2]]), temperature=2.0)
    assert lp2.item() == pytest.approx(-math.log(1 + math.exp(-0.5) + math.exp(-1)), abs=1e-12)


def test_token_logprobs_of_low_precision_logits_are_float32():
    logits = t(LOGITS, torch.bfloat16)
    got = token_logprobs(logits, torch.tensor(TOKENS), 0.7)
    assert got.dtype == torch.float32
    expected = token_logprobs(logits.to(D), torch.tensor(TOKENS), 0.7)
    assert torch.allclose(got.to(D), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_token_entropy_matches_manual_math(temperature):
    got = token_entropy(t(LOGITS), temperature)
    expected = []
    for b in range(2):
        row = []
        for i in range(2):
            lp = manual_log_softmax(LOGITS[b][i], temperature)
            row.append(-sum(math.exp(x) * x for x in lp))
        expected.append(row)
    assert got.shape == (2, 2)
    assert torch.allclose(got, t(expected), atol=1e-12, rtol=0)


def test_token_entropy_of_uniform_logits_is_log_vocab_at_any_temperature():
    for temperature in (0.3, 1.0, 5.0):
        assert token_entropy(t([[[2.0] * 8]]), temperature).item() == pytest.approx(math.log(8), abs=1e-12)


def test_low_temperature_sharpens_the_distribution():
    logits = t([[[1.0, 2.0, 3.0, -1.0]]])
    assert token_entropy(logits, 0.5).item() < token_entropy(logits, 1.0).item() < token_entropy(logits, 2.0).item()


# -- the clipped policy loss -----------------------------------------------------------------------
# per-token loss -min(r A, clip(r, 0.8, 1.28) A), by hand
PER_TOKEN = [
    # ratio, advantage, loss
    (0.5, 1.0, -0.5),    # below the band, A > 0: the unclipped r A is smaller, no clip
    (1.0, 1.0, -1.0),    # inside
    (1.1, 1.0, -1.1),    # inside
    (1.5, 1.0, -1.28),   # above the band, A > 0: clipped to 1.28
    (0.5, -1.0, 0.8),    # below the band, A < 0: clipped to 0.8
    (1.0, -1.0, 1.0),    # inside
    (1.5, -1.0, 1.5),    # above the band, A < 0: unclipped (pessimistic) 1.5
    (0.5, 2.0, -1.0),
    (1.5, 2.0, -2.56),
    (0.25, -0.5, 0.4),   # 0.8 * 0.5
    (3.0, -0.5, 1.5),    # 3.0 * 0.5
    (1.5, 0.0, 0.0),
    (0.5, 0.0, 0.0),
]


@pytest.mark.parametrize("ratio,adv,loss", PER_TOKEN)
def test_per_token_loss_by_hand(ratio, adv, loss):
    got, _ = clipped_policy_loss(t([[math.log(ratio)]]), t([[0.0]]), t([adv]), t([[1.0]]), LOW, HIGH)
    assert got.item() == pytest.approx(loss, abs=1e-12)


def test_per_token_loss_uses_the_log_ratio_not_the_raw_logprobs():
    # the same ratio 1.5 from other absolute logprobs gives the same loss
    got, _ = clipped_policy_loss(t([[math.log(1.5) - 3.0]]), t([[-3.0]]), t([1.0]), t([[1.0]]), LOW, HIGH)
    assert got.item() == pytest.approx(-1.28, abs=1e-12)


# a batch: row 0 has A = +1, row 1 has A = -1, ratios 0.5, 1.0, 1.5; row 1's last token is padding
RATIOS = [[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]
LOGP = [[math.log(r) for r in row] for row in RATIOS]
OLD = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
ADV = [1.0, -1.0]
MASK = [[1, 1, 1], [1, 1, 0]]


def test_token_mean_loss_by_hand():
    loss, _ = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    # (-0.5 - 1.0 - 1.28 + 0.8 + 1.0) / 5 tokens
    assert loss.item() == pytest.approx(-0.98 / 5, abs=1e-12)


def test_padding_tokens_do_not_count_whatever_they_hold():
    base, _ = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    junk = [row[:] for row in LOGP]
    junk[1][2] = 40.0  # an absurd log ratio under the mask
    loss, stats = clipped_policy_loss(t(junk), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    assert loss.item() == pytest.approx(base.item(), abs=1e-12)
    assert stats["ratio_max"].item() == pytest.approx(1.5, abs=1e-12)


def test_bool_mask_works_like_a_float_mask():
    a, _ = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    b, _ = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), torch.tensor(MASK, dtype=torch.bool), LOW, HIGH)
    assert a.item() == pytest.approx(b.item(), abs=1e-15)


def test_per_token_advantages_equal_broadcast_per_response_advantages():
    a, _ = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    b, _ = clipped_policy_loss(t(LOGP), t(OLD), t([[1.0] * 3, [-1.0] * 3]), t(MASK), LOW, HIGH)
    assert a.item() == pytest.approx(b.item(), abs=1e-15)


def test_num_tokens_overrides_the_denominator():
    loss, _ = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH, num_tokens=20)
    assert loss.item() == pytest.approx(-0.98 / 20, abs=1e-12)


def test_an_all_padding_micro_batch_has_zero_loss():
    loss, stats = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), torch.zeros(2, 3, dtype=D), LOW, HIGH)
    assert loss.item() == 0.0
    assert stats["tokens"].item() == 0.0
    assert stats["ratio_max"].item() == 0.0


def test_masked_max_selects_away_masked_positions_without_a_branch_on_the_mask():
    from offpolicy.learner.algorithms import masked_max

    values = t([[0.5, float("inf"), 2.0], [float("nan"), 3.0, 1.0]])
    mask = t([[1, 0, 1], [0, 0, 1]])
    assert masked_max(values, mask).item() == 2.0  # inf and NaN under the mask never count
    assert masked_max(values, torch.zeros(2, 3, dtype=D)).item() == 0.0
    assert masked_max(torch.zeros(2, 0, dtype=D), torch.zeros(2, 0, dtype=D)).item() == 0.0
    calls = []
    real = torch.Tensor.__bool__
    torch.Tensor.__bool__ = lambda self: calls.append(1) or real(self)  # a host branch on a tensor would sync
    try:
        masked_max(values, mask)
        clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    finally:
        torch.Tensor.__bool__ = real
    assert not calls


def test_stats_by_hand():
    _, st = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(MASK), LOW, HIGH)
    assert st["tokens"].item() == 5
    assert st["clip_low_tokens"].item() == 1  # row 1, ratio 0.5 < 0.8 with A < 0
    assert st["clip_high_tokens"].item() == 1  # row 0, ratio 1.5 > 1.28 with A > 0
    assert st["ratio_sum"].item() == pytest.approx(0.5 + 1.0 + 1.5 + 0.5 + 1.0, abs=1e-12)
    assert st["ratio_max"].item() == pytest.approx(1.5, abs=1e-12)
    # k1 = logp_old - logp summed: -(ln .5 + ln 1.5 + ln .5) = ln(8/3)
    assert st["kl_sum"].item() == pytest.approx(math.log(8 / 3), abs=1e-12)
    assert all(not v.requires_grad for v in st.values())


def test_clip_events_count_only_where_the_clip_binds():
    # ratio 0.5 with A > 0 and ratio 1.5 with A < 0 are outside the band but not clipped; padding never counts
    ratios = [[0.5, 1.5, 0.7, 1.3], [0.5, 1.5, 0.7, 1.3]]
    logp = t([[math.log(r) for r in row] for row in ratios], D)
    mask = t([[1, 1, 1, 1], [1, 1, 1, 0]])
    _, st = clipped_policy_loss(logp, torch.zeros(2, 4, dtype=D), t([1.0, -1.0]), mask, LOW, HIGH)
    assert st["clip_high_tokens"].item() == 2  # row 0: 1.5 and 1.3
    assert st["clip_low_tokens"].item() == 2  # row 1: 0.5 and 0.7 (1.3 is padding, and would not count)


def test_stats_respect_the_mask():
    mask = [[1, 1, 0], [0, 1, 0]]  # drops both clip events
    _, st = clipped_policy_loss(t(LOGP), t(OLD), t(ADV), t(mask), LOW, HIGH)
    assert (st["tokens"].item(), st["clip_low_tokens"].item(), st["clip_high_tokens"].item()) == (3, 0, 0)
    assert st["ratio_sum"].item() == pytest.approx(2.5, abs=1e-12)
    assert st["kl_sum"].item() == pytest.approx(math.log(2), abs=1e-12)


def random_batch(seed=0, b=6, t_=7):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(b, t_, generator=g, dtype=D) * 3
    logp = logp_old + (torch.rand(b, t_, generator=g, dtype=D) - 0.5) * 1.6  # ratios ~ 0.45 .. 2.2
    adv = torch.randn(b, generator=g, dtype=D)
    lengths = [7, 3, 5, 1, 6, 4]
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(t_)] for n in lengths[:b]], dtype=D)
    return logp, logp_old, adv, mask


def test_micro_batch_losses_with_the_batch_token_count_sum_to_the_batch_loss():
    logp, old, adv, mask = random_batch()
    full, full_st = clipped_policy_loss(logp, old, adv, mask, LOW, HIGH)
    n = mask.sum().item()
    parts = [clipped_policy_loss(logp[i:j], old[i:j], adv[i:j], mask[i:j], LOW, HIGH, num_tokens=n)
             for i, j in [(0, 1), (1, 4), (4, 6)]]
    assert sum(p[0].item() for p in parts) == pytest.approx(full.item(), abs=1e-12)
    for key in ("tokens", "clip_low_tokens", "clip_high_tokens", "ratio_sum", "kl_sum"):
        assert sum(p[1][key].item() for p in parts) == pytest.approx(full_st[key].item(), abs=1e-12)
    # and the accumulated gradient is the full batch's
    x = logp.clone().requires_grad_(True)
    clipped_policy_loss(x, old, adv, mask, LOW, HIGH)[0].backward()
    y = logp.clone().requires_grad_(True)
    for i, j in [(0, 1), (1, 4), (4, 6)]:
        clipped_policy_loss(y[i:j], old[i:j], adv[i:j], mask[i:j], LOW, HIGH, num_tokens=n)[0].backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-12, rtol=0)


def test_micro_batch_losses_with_their_own_token_count_do_not_sum_to_the_batch_loss():
    # why num_tokens exists: the default per-micro-batch mean weights tokens unequally
    logp, old, adv, mask = random_batch()
    full, _ = clipped_policy_loss(logp, old, adv, mask, LOW, HIGH)
    parts = sum(clipped_policy_loss(logp[i:j], old[i:j], adv[i:j], mask[i:j], LOW, HIGH)[0].item()
                for i, j in [(0, 1), (1, 4), (4, 6)])
    assert abs(parts - full.item()) > 1e-3


def reference_loss(logp, logp_old, adv, mask, low, high):
    """Element by element, in the piecewise form: A > 0 caps the ratio at 1 + high, A < 0 floors it at 1 - low."""
    total = torch.zeros((), dtype=D)
    count = 0
    for i in range(logp.shape[0]):
        a = float(adv[i])
        for j in range(logp.shape[1]):
            if mask[i, j] == 0:
                continue
            count += 1
            r = torch.exp(logp[i, j] - logp_old[i, j])
            if a > 0:
                total = total - a * torch.clamp(r, max=1 + high)
            elif a < 0:
                total = total - a * torch.clamp(r, min=1 - low)
    return total / max(count, 1)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_loss_and_gradient_match_a_plain_reference(seed, low, high):
    logp, old, adv, mask = random_batch(seed)
    x = logp.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(x, old, adv, mask, low, high)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    ref = reference_loss(y, old, adv, mask, low, high)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(x.grad, y.grad, atol=1e-12, rtol=0)
    ratio = torch.exp(logp - old)
    a = adv.unsqueeze(-1).expand_as(ratio)
    clipped = ((a > 0) & (ratio > 1 + high)) | ((a < 0) & (ratio < 1 - low))
    # the batch really covers clipped and unclipped tokens, and clipped tokens get no gradient
    assert (clipped & (mask > 0)).any() and (~clipped & (mask > 0)).any()
    assert torch.all(x.grad[clipped] == 0)
    assert torch.all(x.grad[mask == 0] == 0)


def test_gradient_by_hand():
    # d/dlogp of -min(rA, clip(r)A) / N is -rA / N where unclipped, 0 where clipped
    x = t(LOGP).requires_grad_(True)
    clipped_policy_loss(x, t(OLD), t(ADV), t(MASK), LOW, HIGH)[0].backward()
    expected = [[-0.5 / 5, -1.0 / 5, 0.0], [0.0, 1.0 / 5, 0.0]]
    assert torch.allclose(x.grad, t(expected), atol=1e-12, rtol=0)
