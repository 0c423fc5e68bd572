"""Tests for offpolicy.hub.validation.check_group: a good group passes, each bad one is refused with the
reason whose label (the text before the colon) the hub uses as a metric label."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from offpolicy.hub.validation import FINISH_REASONS, check_group
from offpolicy.wire.protocol import LOGPROB_DTYPE, TOKEN_DTYPE, SampleGroup

LIMITS = dict(n_samples=3, max_new_tokens=4, vocab_size=16, min_version=2, newest_version=5)


def good_group() -> tuple[SampleGroup, list[np.ndarray]]:
    lengths = [1, 4, 2]
    group = SampleGroup(lease_id=1, prompt_id=2, epoch=0, weight_version=3, response_lengths=lengths,
                        rewards=[0.0, 1.0, -0.5], finish_reasons=["stop", "length", "stop"])
    prompt = np.array([11, 0, 15, 3], dtype=TOKEN_DTYPE)
    tokens = np.array([13, 1, 2, 3, 4, 5, 13], dtype=TOKEN_DTYPE)
    logprobs = np.array([-0.1, -2.0, -0.5, -30.0, 0.0, -1e-4, -0.7], dtype=LOGPROB_DTYPE)
    return group, [prompt, tokens, logprobs]


def check(group, arrays, **limits):
    return check_group(group, arrays, **{**LIMITS, **limits})


def label(reason: str) -> str:
    return reason.split(":")[0]


def test_good_group_passes():
    group, arrays = good_group()
    assert check(group, arrays) is None


@pytest.mark.parametrize("limits", [
    dict(min_version=3),  # version equal to the lease minimum
    dict(newest_version=3),  # version equal to the newest published
    dict(min_version=None),  # lease unknown: no lower bound
    dict(min_version=None, newest_version=3),
    dict(vocab_size=16),  # largest token id is vocab_size - 1
])
def test_boundaries_pass(limits):
    group, arrays = good_group()
    assert check(group, arrays, **limits) is None


def test_tiny_positive_logprob_from_float_noise_passes():
    group, arrays = good_group()
    arrays[2][0] = 5e-4
    assert check(group, arrays) is None


def test_version_zero_passes_without_a_minimum():
    group, arrays = good_group()
    group = msgspec.structs.replace(group, weight_version=0)
    assert check(group, arrays, min_version=None, newest_version=0) is None


def test_every_finish_reason_passes():
    group, arrays = good_group()
    for reason in FINISH_REASONS:
        group = msgspec.structs.replace(group, finish_reasons=[reason] * 3)
        assert check(group, arrays) is None
    assert set(FINISH_REASONS) == {"stop", "length"}


@pytest.mark.parametrize("n_samples", [2, 4])
def test_wrong_group_size_is_refused(n_samples):
    group, arrays = good_group()
    reason = check(group, arrays, n_samples=n_samples)
    assert reason.startswith("group size:")
    assert f"3 responses, expected {n_samples}" in reason


@pytest.mark.parametrize("lengths, tokens", [
    ([0, 4, 2], 6),  # an empty response
    ([1, 5, 2], 8),  # over max_new_tokens
    ([0, 0, 0], 0),
])
def test_response_length_outside_limits_is_refused(lengths, tokens):
    group, arrays = good_group()
    group = msgspec.structs.replace(group, response_lengths=lengths)
    arrays[1] = np.ones(tokens, dtype=TOKEN_DTYPE)
    arrays[2] = -np.ones(tokens, dtype=LOGPROB_DTYPE)
    reason = check(group, arrays)
    assert reason.startswith("response length:")
    assert "1..4" in reason


@pytest.mark.parametrize("frame, index, token", [
    (0, 0, 16),  # prompt: == vocab_size
    (0, 3, -1),  # prompt: negative
    (0, 1, 2**31 - 1),
    (1, 0, 16),  # responses: == vocab_size
    (1, 6, 1000),
    (1, 2, -5),
])
def test_token_id_outside_the_vocabulary_is_refused(frame, index, token):
    group, arrays = good_group()
    arrays[frame][index] = token
    reason = check(group, arrays)
    assert reason.startswith("token id:")
    assert "16" in reason


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.5, 1e-2])
def test_bad_logprob_is_refused(value):
    group, arrays = good_group()
    arrays[2][4] = value
    assert check(group, arrays).startswith("logprob:")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused(value):
    group, arrays = good_group()
    group = msgspec.structs.replace(group, rewards=[0.0, value, 1.0])
    assert check(group, arrays).startswith("reward:")


@pytest.mark.parametrize("bad", ["abort", "", "STOP", "eos"])
def test_unknown_finish_reason_is_refused(bad):
    group, arrays = good_group()
    group = msgspec.structs.replace(group, finish_reasons=["stop", bad, "length"])
    reason = check(group, arrays)
    assert reason.startswith("finish reason:")
    assert "stop" in reason and "length" in reason


@pytest.mark.parametrize("version, min_version", [(1, 2), (-1, 0), (4, 5)])
def test_version_below_the_lease_minimum_is_refused(version, min_version):
    group, arrays = good_group()
    group = msgspec.structs.replace(group, weight_version=version)
    reason = check(group, arrays, min_version=min_version)
    assert reason.startswith("version:")
    assert "below the lease minimum" in reason and str(min_version) in reason


@pytest.mark.parametrize("version, newest, min_version", [(6, 5, 2), (1, 0, None), (0, -1, None)])
def test_version_above_the_newest_is_refused(version, newest, min_version):
    group, arrays = good_group()
    group = msgspec.structs.replace(group, weight_version=version)
    reason = check(group, arrays, min_version=min_version, newest_version=newest)
    assert reason.startswith("version:")
    assert "never published" in reason and f"newest {newest}" in reason


def test_labels_are_short_metric_labels():
    group, arrays = good_group()
    bad_cases = [
        check(group, arrays, n_samples=2),
        check(msgspec.structs.replace(group, rewards=[math.nan] * 3), arrays),
        check(msgspec.structs.replace(group, finish_reasons=["x"] * 3), arrays),
        check(msgspec.structs.replace(group, weight_version=9), arrays),
        check(group, arrays, vocab_size=4),
    ]
    assert [label(r) for r in bad_cases] == ["group size", "reward", "finish reason", "version", "token id"]


def test_check_group_does_not_modify_its_inputs():
    group, arrays = good_group()
    before = (msgspec.structs.replace(group), [a.copy() for a in arrays])
    check(group, arrays, vocab_size=4)
    assert group == before[0]
    for a, b in zip(arrays, before[1]):
        np.testing.assert_array_equal(a, b)


# --- per-token version runs (rollout.inflight_updates) ---------------------------------------------------
def runs_group(runs, weight_version=3):
    from offpolicy.wire.protocol import VersionRun

    group, arrays = good_group()  # response lengths 1, 4, 2
    runs = [[VersionRun(*r) for r in rs] for rs in runs]
    return msgspec.structs.replace(group, weight_version=weight_version, version_runs=runs), arrays


def test_well_formed_version_runs_pass():
    group, arrays = runs_group([[(0, 3)], [(0, 3), (1, 4), (3, 5)], [(0, 3), (1, 5)]])
    assert check(group, arrays) is None
    assert check(group, arrays, newest_version=5, min_version=3) is None


@pytest.mark.parametrize("runs, weight_version, limits, why", [
    ([[(0, 3)], [(0, 4), (1, 3)], [(0, 3)]], 3, {}, "not strictly increasing"),  # non-increasing versions
    ([[(0, 3)], [(0, 3), (2, 4), (2, 5)], [(0, 3)]], 3, {}, "not strictly increasing"),  # non-increasing starts
    ([[(0, 3)], [(0, 3), (4, 4)], [(0, 3)]], 3, {}, "starting at token 4 of 4"),  # out of the response
    ([[(0, 3)], [(0, 3), (1, 6)], [(0, 3)]], 3, {}, "version 6 was never published (newest 5)"),  # newer than announced
    ([[(0, 3)], [(0, 3), (1, 4)], [(0, 3)]], 3, dict(newest_version=3), "never published"),
    ([[(0, 4)], [(0, 4)], [(0, 4), (1, 5)]], 3, {}, "the oldest version is 4"),  # weight_version not the oldest
    ([[(0, 3)], [(0, 3)]], 3, {}, "2 run lists for 3 responses"),
])
def test_malformed_version_runs_are_refused(runs, weight_version, limits, why):
    group, arrays = runs_group(runs, weight_version)
    problem = check(group, arrays, **limits)
    assert problem is not None and label(problem) == "version runs" and why in problem, problem


def test_the_lease_minimum_holds_for_the_oldest_token():
    group, arrays = runs_group([[(0, 2)], [(0, 2), (1, 4)], [(0, 3)]], weight_version=2)
    assert label(check(group, arrays, min_version=3)) == "version"  # a token of version 2 under a lease of >= 3
