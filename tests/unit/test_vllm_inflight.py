"""Weight updates in flight on vLLM servers, the pure parts: what a paused worker's runner says each request has
sampled (`vllm/progress.py`, vLLM's V1 and V2 runners as stand-ins), and each sample's per-token versions from the
switches' counts or from vLLM 0.32's labels, and the Switcher's thread against stand-in servers (`vllm/inflight.py`).
The real servers: tests/integration/test_vllm_engine.py, `check_inflight`."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from offpolicy.rollout.engines.errors import EngineError, VersionMismatch, WeightUpdateError
from offpolicy.rollout.engines.vllm.inflight import Switch, Switcher, runs_of, span_runs
from offpolicy.rollout.engines.vllm.progress import counts, sample_key, sampled, sampled_lengths
from offpolicy.wire.protocol import VersionRun as R


def v1_runner(outputs: dict[str, list[int]]):
    """vLLM's V1 GPUModelRunner: a CachedRequestState a request."""
    return types.SimpleNamespace(requests={rid: types.SimpleNamespace(output_token_ids=list(t))
                                           for rid, t in outputs.items()})


def v2_runner(prompts: dict[str, list[int]], outputs: dict[str, list[int]], rows: int = 6, width: int = 32):
    """vLLM 0.26's V2 runner: `req_states` with the prompt then the sampled tokens of each request in a row of
    `all_token_ids`, `total_len` its end, rows handed out from the back as vLLM's free list does."""
    all_ids, total = torch.zeros(rows, width, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    prompt_len, index = np.zeros(rows, dtype=np.int32), {}
    for rid, row in zip(prompts, range(rows - 1, -1, -1)):
        ids = prompts[rid] + outputs[rid]
        all_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        all_ids[row, len(ids):] = 99  # what an earlier request left in the row
        total[row], prompt_len[row], index[rid] = len(ids), len(prompts[rid]), row
    states = types.SimpleNamespace(req_id_to_index=index, all_token_ids=types.SimpleNamespace(gpu=all_ids),
                                   total_len=types.SimpleNamespace(gpu=total),
                                   prompt_len=types.SimpleNamespace(np=prompt_len))
    return types.SimpleNamespace(req_states=states)


def test_both_runners_give_each_request_its_sampled_tokens_only():
    outputs = {"0_generate-tokens-offpolicy-ab12-0-1f2e3d4c": [5, 6, 7], "1_generate-tokens-offpolicy-ab12-0-1f2e3d4c":
               [5], "generate-tokens-offpolicy-ab12-1-00aa00bb": []}
    prompts = {rid: [11, 1, 2, 12][:2 + i] for i, rid in enumerate(outputs)}
    assert sampled(v1_runner(outputs)) == outputs
    assert sampled(v2_runner(prompts, outputs)) == outputs
    lengths = {rid: len(t) for rid, t in outputs.items()}
    assert sampled_lengths(v1_runner(outputs)) == lengths == sampled_lengths(v2_runner(prompts, outputs))
    for read in (sampled, sampled_lengths):
        with pytest.raises(TypeError, match="neither `requests`.*rollout.inflight_updates=false"):
            read(types.SimpleNamespace())


@pytest.mark.parametrize("vllm_id, key", [
    ("3_generate-tokens-offpolicy-0a1b2c3d4e5f-17-9e0a7607", ("offpolicy-0a1b2c3d4e5f-17", 3)),  # n > 1, tokens API
    ("generate-tokens-offpolicy-0a1b2c3d4e5f-2-12345678", ("offpolicy-0a1b2c3d4e5f-2", 0)),  # one sample
    ("0_offpolicy-0a1b2c3d4e5f-5-deadbeef", ("offpolicy-0a1b2c3d4e5f-5", 0)),  # in process: no API prefix
    ("generate-tokens-offpolicy-0a1b2c3d4e5f-4", ("offpolicy-0a1b2c3d4e5f-4", 0)),  # a response's id: no suffix
    ("1_cmpl-someone-else-1234abcd", None),  # another client's request
])
def test_sample_keys(vllm_id, key):
    assert sample_key(vllm_id) == key


def test_counts_leave_other_clients_requests_out():
    assert counts({"2_generate-tokens-offpolicy-ab-1-0badf00d": 7, "chat-x-1": 3}) == {("offpolicy-ab-1", 2): 7}


K = ("offpolicy-ab-0", 1)


@pytest.mark.parametrize("found, length, runs", [
    ([], 10, [R(0, 4)]),  # no switch: the version it began on
    ([3], 10, [R(0, 4), R(3, 5)]),  # 3 tokens sampled at the switch to 5
    ([3, 7], 10, [R(0, 4), R(3, 5), R(7, 6)]),
    ([0], 10, [R(0, 5)]),  # nothing sampled yet (its prefill ran): every token from 5
    ([3, 3], 10, [R(0, 4), R(3, 6)]),  # no token between two switches: 5 produced none
    ([10], 10, [R(0, 4)]),  # done at the switch (still in the runner)
    ([None, 6], 10, [R(0, 4), R(6, 6)]),  # the first switch missed it: its tokens to 6 counted to the older version
])
def test_runs_from_the_switches_counts(found, length, runs):
    switches = [Switch(5 + i, {} if n is None else {K: n, ("offpolicy-ab-0", 0): 1}, 0.1) for i, n in enumerate(found)]
    assert runs_of(K, 4, switches, length) == runs


def test_labels_give_the_runs_and_only_versions_the_engine_loaded():
    spans = [{"version": "4", "start": 0, "end": 3}, {"version": "5", "start": 3, "end": 9}]
    assert span_runs(spans, {4, 5}, "x[0]") == [R(0, 4), R(3, 5)]
    with pytest.raises(VersionMismatch, match="weight version '5', not one of \\[4\\]"):
        span_runs(spans, {4}, "x[0]")
    with pytest.raises(EngineError, match="do not start at token 0"):
        span_runs(spans[1:], {4, 5}, "x[0]")


class Servers:
    """What a Switcher uses of VLLMServers: one server, `offpolicy_ready` true from the `ready_after`+1-th ask."""

    def __init__(self, ready_after: int = 0, refuse: bool = False):
        self.servers = [types.SimpleNamespace(url="http://s0", healthy=True, version=4)]
        self.swaps, self.asked, self.ready_after, self.refuse, self.updates = [], 0, ready_after, refuse, []

    def rpc(self, server, method, kwargs, timeout):
        assert method == "offpolicy_ready" and kwargs == {"path": "/store/v5"}
        self.asked += 1
        return [{"ready": self.asked > self.ready_after}]

    def update_weights(self, path, version, servers=None, in_flight=False):
        self.updates.append((path, version, in_flight, self.asked))
        if self.refuse:
            raise WeightUpdateError("http://s0: the load was not proven")
        self.servers[0].version = version
        self.swaps.append({"url": "http://s0", "method": "inplace", "verified": True, "seconds": 0.05,
                           "progress": {K: 3}})


class Engine:
    """What a Switcher uses of VLLMEngine: its version, prefetcher, backend and `take_swaps`."""

    def __init__(self, servers: Servers):
        self.version, self.path, self.backend, self.last_loads, self.switched = 4, "/store/v4", servers, [], []
        wv = types.SimpleNamespace(version=5, path="/store/v5")
        self.prefetcher = types.SimpleNamespace(asked_after=lambda v: wv if wv.version > v else None)

    def take_swaps(self, version):
        self.last_loads, self.backend.swaps = self.backend.swaps, []
        return self.last_loads


def run_until(switcher, done, timeout: float = 30.0):
    with switcher:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)


def test_a_switcher_switches_once_the_servers_say_the_version_is_staged():
    servers = Servers(ready_after=3)
    engine = Engine(servers)
    switcher = Switcher(engine)
    run_until(switcher, lambda: switcher.switches)
    assert servers.updates == [("/store/v5", 5, True, 4)]  # in flight, after the fourth ask said ready; once
    assert (engine.version, engine.path, switcher.error) == (5, "/store/v5", None)
    assert [(s.version, s.progress) for s in switcher.switches] == [(5, {K: 3})] and switcher.loaded == {4, 5}
    assert "progress" not in engine.last_loads[0] and engine.last_loads[0]["inflight_at"] > 0  # traced as in flight
    assert engine.switched == [(5, engine.last_loads)]  # for the prefetcher's drain, each switch's own
    assert runs_of(K, 4, switcher.switches, 10) == [R(0, 4), R(3, 5)]


def test_a_failed_switch_is_kept_for_the_generate_call_and_no_other_is_tried():
    servers = Servers(refuse=True)
    engine = Engine(servers)
    switcher = Switcher(engine)
    run_until(switcher, lambda: switcher.error is not None)
    assert isinstance(switcher.error, WeightUpdateError) and engine.version == 4 and switcher.switches == []
    assert len(servers.updates) == 1  # the thread ended: the generate call raises it once its requests are back
