"""Tests for offpolicy.wire.versions: per-token weight versions as runs (rollout.inflight_updates): built from a
generate call's switches, reduced to a group's (weight_version, version_runs), expanded, and checked."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from offpolicy.wire.protocol import SampleGroup, VersionRun, decode, encode
from offpolicy.wire.versions import check_runs, group_runs, response_runs, token_versions, tokens_after_switch

R = VersionRun


def test_response_runs_cut_the_switches_to_the_response():
    switches = [(0, 3), (4, 4), (9, 6)]
    assert response_runs(switches, 12) == [R(0, 3), R(4, 4), R(9, 6)]
    assert response_runs(switches, 9) == [R(0, 3), R(4, 4)]  # version 6 began after the response ended
    assert response_runs(switches, 4) == [R(0, 3)]
    assert response_runs([(0, 3)], 1) == [R(0, 3)]


def test_token_versions_expand_the_runs():
    np.testing.assert_array_equal(token_versions([R(0, 3), R(2, 4), R(5, 7)], 7), [3, 3, 4, 4, 4, 7, 7])
    np.testing.assert_array_equal(token_versions([R(0, 5)], 3), [5, 5, 5])
    assert tokens_after_switch([R(0, 3), R(2, 4), R(5, 7)], 7) == 5
    assert tokens_after_switch([R(0, 3)], 7) == 0


def test_group_runs_leave_out_runs_when_one_version_made_every_token():
    assert group_runs([[R(0, 4)], [R(0, 4)]]) == (4, [])
    mixed = [[R(0, 4), R(3, 5)], [R(0, 4)]]
    assert group_runs(mixed) == (4, mixed)
    # weight_version is the oldest version of any token, even where responses began on different versions
    late = [[R(0, 5)], [R(0, 4)]]
    assert group_runs(late) == (4, late)


@pytest.mark.parametrize("runs", [[], [[R(0, 4)], [R(0, 4), R(2, 5)]], [[R(0, 4), R(1, 5), R(2, 6)], [R(0, 5)]]])
def test_check_runs_passes_well_formed_runs(runs):
    assert check_runs(runs, [3, 3], 4, newest=6) is None


@pytest.mark.parametrize("runs, why", [
    ([[R(0, 4)]], "1 run lists for 2 responses"),
    ([[R(0, 4)], []], "do not start at token 0"),
    ([[R(0, 4)], [R(1, 4)]], "do not start at token 0"),
    ([[R(0, 4), R(2, 4)], [R(0, 4)]], "not strictly increasing"),  # a version repeated
    ([[R(0, 5), R(2, 4)], [R(0, 4)]], "not strictly increasing"),  # a version going back
    ([[R(0, 4), R(2, 5), R(2, 6)], [R(0, 4)]], "not strictly increasing"),  # two runs at one token
    ([[R(0, 4), R(3, 5)], [R(0, 4)]], "starting at token 3 of 3"),  # a run past the response's end
    ([[R(0, 4), R(1, 7)], [R(0, 4)]], "version 7 was never published (newest 6)"),
    ([[R(0, 5)], [R(0, 5), R(1, 6)]], "the oldest version is 5, the group says weight_version 4"),
])
def test_check_runs_refuses_malformed_runs(runs, why):
    problem = check_runs(runs, [3, 3], 4, newest=6)
    assert problem is not None and problem.startswith("version runs: ") and why in problem, problem


def test_runs_travel_as_msgpack_pairs_and_a_message_without_them_decodes():
    group = SampleGroup(lease_id=1, prompt_id=2, epoch=0, weight_version=4, response_lengths=[2, 3], rewards=[0.0, 1.0],
                        finish_reasons=["stop", "length"], version_runs=[[R(0, 4)], [R(0, 4), R(1, 5)]])
    arrays = [np.array([1, 2], np.int32), np.arange(5, dtype=np.int32), -np.ones(5, np.float32)]
    frames = encode(group, *arrays)
    assert msgspec.msgpack.decode(bytes(frames[0]))["version_runs"] == [[[0, 4]], [[0, 4], [1, 5]]]
    got, _ = decode([bytes(f) for f in frames])
    assert got.version_runs == group.version_runs
    # a header from before the field (what an older rollout sends): every token from weight_version
    raw = msgspec.msgpack.decode(bytes(frames[0]))
    del raw["version_runs"]
    got, _ = decode([msgspec.msgpack.encode(raw), *[bytes(f) for f in frames[1:]]])
    assert got.version_runs is msgspec.UNSET and got.runs_of == []
