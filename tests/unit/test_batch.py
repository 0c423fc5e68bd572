"""split_frames and batch_stats: per-response views on the wire arrays, and step statistics by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from offpolicy.hub.batch import Group, batch_stats, split_frames


def make_group(rewards, lengths, reasons, prompt_id=0, gen_seconds=0.0):
    return Group(prompt_id=prompt_id, epoch=0, lease_id=1, weight_version=0, gen_seconds=gen_seconds,
                 prompt=np.array([11, 1, 12], dtype=np.int32),
                 responses=[np.arange(n, dtype=np.int32) for n in lengths],
                 logprobs=[np.full(n, -0.5, dtype=np.float32) for n in lengths],
                 rewards=np.asarray(rewards, dtype=np.float64), finish_reasons=list(reasons))


# -- split_frames ----------------------------------------------------------------------------------
def test_split_frames_cuts_each_array_by_the_lengths():
    tokens = np.array([5, 6, 7, 8, 9, 10], dtype=np.int32)
    logprobs = np.array([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], dtype=np.float32)
    toks, lps = split_frames([3, 1, 2], tokens, logprobs)
    assert [t.tolist() for t in toks] == [[5, 6, 7], [8], [9, 10]]
    assert [lp.tolist() for lp in lps] == [pytest.approx([-0.1, -0.2, -0.3]), pytest.approx([-0.4]),
                                           pytest.approx([-0.5, -0.6])]
    assert all(t.dtype == np.int32 for t in toks) and all(lp.dtype == np.float32 for lp in lps)


def test_split_frames_returns_views_on_a_writable_frame_not_copies():
    flat = np.arange(6, dtype=np.int32)
    (parts,) = split_frames([2, 4], flat)
    assert all(np.shares_memory(p, flat) for p in parts)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3, 4, 5]]


def test_split_frames_keep_a_received_zmq_frame_alive_and_unchanged():
    import gc

    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://split-frames")
        b.connect("inproc://split-frames")
        a.send(np.arange(4096, dtype=np.int32))
        frame = b.recv(copy=False)
        flat = np.frombuffer(frame.buffer, dtype=np.int32)
        (parts,) = split_frames([96, 4000], flat)
        del frame, flat
        gc.collect()
        for i in range(20):  # later messages get memory of their own, never the frame's
            a.send(np.full(4096, -i, dtype=np.int32))
            b.recv(copy=False)
        assert parts[0].flags.writeable
        assert parts[0].tolist() == list(range(96)) and parts[1].tolist() == list(range(96, 4096))
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_split_frames_single_response_and_zero_length_pieces():
    (one,) = split_frames([4], np.arange(4))
    assert [p.tolist() for p in one] == [[0, 1, 2, 3]]
    (parts,) = split_frames([0, 3, 0], np.arange(3))
    assert [p.tolist() for p in parts] == [[], [0, 1, 2], []]


def test_split_frames_of_read_only_buffers_are_writable():
    flat = np.frombuffer(np.arange(4, dtype=np.int32).tobytes(), dtype=np.int32)  # like a zmq frame
    assert not flat.flags.writeable
    (parts,) = split_frames([1, 3], flat)
    assert all(p.flags.writeable for p in parts)


# -- Group -----------------------------------------------------------------------------------------
def test_group_n_and_num_tokens():
    g = make_group([1.0, 0.0, 0.5], [3, 1, 4], ["stop", "stop", "length"])
    assert g.n == 3
    assert g.num_tokens == 8


# -- batch_stats -----------------------------------------------------------------------------------
def test_batch_stats_by_hand():
    groups = [make_group([1.0, 0.25], [3, 2], ["stop", "length"], gen_seconds=0.5),
              make_group([0.0, 0.5, 0.75], [1, 4, 4], ["length", "length", "stop"], prompt_id=1, gen_seconds=1.5)]
    st = batch_stats(groups)
    assert st["generate_seconds"] == pytest.approx(1.0, abs=1e-12)  # each group's generate call, mean
    # rewards 1, .25, 0, .5, .75: mean .5; squared deviations .25 .0625 .25 0 .0625 -> var .125 (population)
    assert st["reward_mean"] == pytest.approx(0.5, abs=1e-12)
    assert st["reward_std"] == pytest.approx(math.sqrt(0.125), abs=1e-12)
    assert (st["reward_max"], st["reward_min"]) == (1.0, 0.0)
    # lengths 3 2 1 4 4
    assert st["response_len_mean"] == pytest.approx(2.8, abs=1e-12)
    assert st["response_len_max"] == 4
    assert st["tokens"] == 14
    assert st["truncated_frac"] == pytest.approx(3 / 5, abs=1e-12)


def test_batch_stats_values_are_plain_python_numbers():
    st = batch_stats([make_group([1.0, 0.0], [2, 2], ["stop", "stop"])])
    assert all(type(v) in (int, float) for v in st.values()), {k: type(v) for k, v in st.items()}
    assert st["truncated_frac"] == 0.0
    assert st["reward_std"] == pytest.approx(0.5, abs=1e-12)


# -- per-token versions (rollout.inflight_updates) ----------------------------------------------------
def test_version_stats_by_hand():
    from offpolicy.hub.batch import version_stats
    from offpolicy.wire.protocol import VersionRun as R

    plain = make_group([0.0, 1.0], [2, 3], ["stop", "stop"])  # every token from version 0
    switched = make_group([0.0, 1.0], [4, 2], ["stop", "stop"], prompt_id=1)
    switched.version_runs = [[R(0, 0), R(1, 1)], [R(0, 0)]]  # 3 of its 6 tokens from version 1
    assert switched.newest_version == 1 and plain.newest_version == 0
    assert [v.tolist() for v in switched.token_versions()] == [[0, 1, 1, 1], [0, 0]]
    s = version_stats([plain, switched], step=1)
    # tokens' staleness at step 1: 2 + 3 + 1 + 2 tokens of version 0 (staleness 1), 3 of version 1 (0)
    assert s["token_staleness_mean"] == pytest.approx(8 / 11)
    assert (s["token_staleness_max"], s["token_staleness_min"]) == (1, 0)
    assert s["switched_token_frac"] == pytest.approx(3 / 11)
    assert s["switched_response_frac"] == pytest.approx(1 / 4)
    assert version_stats([plain], step=0) == {"token_staleness_mean": 0.0, "token_staleness_max": 0,
                                              "token_staleness_min": 0, "switched_token_frac": 0.0,
                                              "switched_response_frac": 0.0}
