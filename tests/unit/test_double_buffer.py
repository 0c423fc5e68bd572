"""Tests for offpolicy.rollout.engines.double_buffer (`rollout.double_buffer`) and the torch engine driving it:
a version read in the background is not used before its swap, the swap is a pointer swap between the two
banks, superseded, failed and closed reads, the follower handing versions to the prefetcher, and `auto`."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.config import ConfigError, load_config
from offpolicy.models.build import build_model, checkpoint_tensors, hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams, prefetcher_of
from offpolicy.rollout.engines.double_buffer import DoubleBuffer, double_buffered, weight_bytes
from offpolicy.rollout.engines.errors import EngineError, VersionRefused
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightStore, WeightVersion
from tests.polling import poll

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 9, 8, 7, 12]]
GREEDY = SamplingParams(n=2, top_k=1, max_new_tokens=6)


def config(*overrides: str):
    return load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", *overrides])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Versions 1, 2, 3 of the quickstart model, from seeds 7, 8, 9."""
    store = WeightStore(str(tmp_path_factory.mktemp("store")), "db", keep=10)
    for v in (1, 2, 3):
        model = build_model(config(f"model.seed={6 + v}").model, torch.device("cpu"))
        store.publish(v, hf_state(model), hf_config(model))
    return store


def held(store, version: int) -> WeightVersion:
    return WeightVersion(Path(store.root) / store.run / f"v{version}")


@pytest.fixture(scope="module")
def references(store):
    """Greedy completions of an engine that loaded each version in place (no double buffer)."""
    engine = TorchEngine(config("rollout.double_buffer=false"), seed=0)
    out = {0: engine.generate(PROMPTS, GREEDY)}
    for v in (1, 2, 3):
        with held(store, v) as wv:
            engine.load(wv)
        out[v] = engine.generate(PROMPTS, GREEDY)
    return out


def same(a, b) -> bool:
    return all(x.tokens.tolist() == y.tokens.tolist() and np.allclose(x.logprobs, y.logprobs, atol=1e-5)
               for ga, gb in zip(a, b) for x, y in zip(ga, gb))


def test_each_generate_call_uses_the_version_swapped_in_never_one_read_in_the_background(store, references):
    # swaps between generate calls only: with rollout.inflight_updates (on by auto with the double buffer) the ready
    # version would be switched to between decode steps (tests/unit/test_torch_engine_inflight.py)
    engine = TorchEngine(config("rollout.double_buffer=true", "rollout.inflight_updates=false"), seed=0)
    buf = engine.prefetcher
    assert buf is not None and prefetcher_of(config(), engine) is buf
    assert same(engine.generate(PROMPTS, GREEDY), references[0])
    for v in (1, 2, 3):
        wv = held(store, v)
        buf.prefetch(wv)  # what the daemon's follower does when it hears of v
        poll(lambda: buf.ready == v, 60.0)  # read completely into the spare bank...
        assert engine.version == (v - 1 or -1) and same(engine.generate(PROMPTS, GREEDY), references[v - 1])  # unused
        live = [t.data_ptr() for t in checkpoint_tensors(engine.model).values()]
        assert engine.load(wv) >= 0 and engine.version == v
        wv.close()
        assert same(engine.generate(PROMPTS, GREEDY), references[v])
        # a pointer swap: the parameters now use the other bank's storage; the old one is the spare
        now = checkpoint_tensors(engine.model)
        assert [t.data_ptr() for t in now.values()] == [t.data_ptr() for t in buf.banks[buf.live].values()]
        assert [t.data_ptr() for t in buf.banks[1 - buf.live].values()] == live
    assert [r.outcome for r in buf.drain()] == ["swapped"] * 3
    engine.close()


def test_load_without_a_prefetch_reads_then_swaps(store, references):
    engine = TorchEngine(config("rollout.double_buffer=true"), seed=0)
    with held(store, 2) as wv:
        engine.load(wv)
    assert engine.version == 2 and same(engine.generate(PROMPTS, GREEDY), references[2])
    records = engine.prefetcher.drain()
    assert [(r.version, r.outcome) for r in records] == [(2, "swapped")] and records[0].seconds > 0
    assert 0 <= records[0].cpu_seconds  # the reading thread's own CPU time
    engine.close()


def test_tied_weights_stay_tied_across_swaps(tmp_path):
    cfg = config("model.arch.tie_word_embeddings=true", "rollout.double_buffer=true")
    engine = TorchEngine(cfg, seed=0)
    source = build_model(config("model.arch.tie_word_embeddings=true", "model.seed=3").model, torch.device("cpu"))
    pub = WeightStore(str(tmp_path), "tied", keep=4).publish(1, hf_state(source), hf_config(source))
    with WeightVersion(pub.path) as wv:
        engine.load(wv)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert torch.equal(engine.model.lm_head.weight, source.model.embed_tokens.weight)
    assert weight_bytes(engine.model) == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    engine.close()


class Gated:
    """A `read` that fills every tensor with the version number, each read waiting for its own gate first."""

    def __init__(self):
        self.gates: dict[int, threading.Event] = {}
        self.started: list[int] = []
        self.fail: set[int] = set()

    def gate(self, version: int) -> threading.Event:
        return self.gates.setdefault(version, threading.Event())

    def __call__(self, wv: WeightVersion, dest: dict[str, torch.Tensor]) -> None:
        self.started.append(wv.version)
        assert self.gate(wv.version).wait(60)
        if wv.version in self.fail:
            raise OSError(f"bad shard of version {wv.version}")
        with torch.no_grad():
            for t in dest.values():
                t.fill_(float(wv.version))


def live_value(model) -> float:
    return float(model.lm_head.weight.detach().flatten()[0])


@pytest.fixture
def gated():
    model = build_model(config().model, torch.device("cpu"))
    read = Gated()
    buf = DoubleBuffer(model, read, torch.device("cpu"))
    yield model, read, buf
    for g in read.gates.values():
        g.set()
    buf.close()


def test_a_prefetch_superseded_by_newer_versions_reads_only_the_newest_next(store, gated):
    model, read, buf = gated
    before = live_value(model)
    buf.prefetch(held(store, 1))
    poll(lambda: read.started == [1], 60.0)
    buf.prefetch(held(store, 2))  # replaced by 3 before it starts: never read
    buf.prefetch(held(store, 3))
    assert live_value(model) == before  # nothing is live before a swap
    read.gate(1).set()  # 1 completes, then 3 is read over it
    read.gate(3).set()
    buf.swap_in(3)
    assert read.started == [1, 3] and live_value(model) == 3.0 and buf.live == 1
    assert sorted((r.version, r.outcome) for r in buf.drain()) == [(1, "superseded"), (2, "superseded"),
                                                                   (3, "swapped")]


def test_a_ready_version_a_swap_waits_for_is_not_read_over(store, gated):
    model, read, buf = gated
    buf.prefetch(held(store, 1))
    read.gate(1).set()
    poll(lambda: buf.ready == 1, 60.0)
    with buf._cv:  # a swap for 1 is waiting (holds the lock's turn) when 2 arrives
        buf._awaited = 1
        buf.prefetch(held(store, 2))
    time.sleep(0.1)
    assert read.started == [1] and buf.ready == 1  # 2 waits until 1 is swapped in
    buf.swap_in(1)
    assert live_value(model) == 1.0
    read.gate(2).set()
    poll(lambda: buf.ready == 2, 60.0)
    buf.swap_in(2)
    assert live_value(model) == 2.0 and read.started == [1, 2]


def test_a_failed_read_leaves_the_current_version_serving_and_is_reported(store, gated, caplog):
    model, read, buf = gated
    read.gate(1).set()
    buf.prefetch(held(store, 1))
    buf.swap_in(1)
    read.fail.add(2)
    read.gate(2).set()
    with caplog.at_level(logging.ERROR, logger="offpolicy.rollout.engines.torch"):
        buf.prefetch(held(store, 2))
        with pytest.raises(VersionRefused, match="weight version 2 .*OSError: bad shard of version 2"):
            buf.swap_in(2)
    assert live_value(model) == 1.0 and buf.live == 1  # untouched
    assert "weight version 2 failed to read into the spare weights" in caplog.text
    records = buf.drain()
    assert [(r.version, r.outcome) for r in records] == [(1, "swapped"), (2, "failed")]
    assert "bad shard" in records[1].error
    buf.prefetch(held(store, 2))  # a failed version is not read again
    time.sleep(0.05)
    assert read.started == [1, 2]
    read.gate(3).set()
    buf.prefetch(held(store, 3))  # a newer one is
    buf.swap_in(3)
    assert live_value(model) == 3.0


def test_a_bad_shard_file_is_refused_by_the_engine_which_keeps_serving(tmp_path, references, caplog):
    engine = TorchEngine(config("rollout.double_buffer=true"), seed=0)
    ws = WeightStore(str(tmp_path), "bad", keep=4)
    for v in (1, 2):
        model = build_model(config(f"model.seed={6 + v}").model, torch.device("cpu"))
        ws.publish(v, hf_state(model), hf_config(model))
    with WeightVersion(tmp_path / "bad" / "v1") as wv:
        engine.load(wv)
    shard = next((tmp_path / "bad" / "v2").glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)  # the bad file: its last tensor ends past the end
    with caplog.at_level(logging.ERROR), WeightVersion(tmp_path / "bad" / "v2") as wv:
        with pytest.raises(VersionRefused, match="weight version 2 .*inconsistent offsets"):
            engine.load(wv)
    assert "weight version 2 failed to read into the spare weights" in caplog.text
    assert engine.version == 1 and same(engine.generate(PROMPTS, GREEDY), references[1])
    engine.close()


def test_close_during_a_prefetch_ends_it_and_wakes_a_waiting_swap(store, gated):
    model, read, buf = gated
    before = live_value(model)
    wv = held(store, 1)
    buf.prefetch(wv)
    poll(lambda: read.started == [1], 60.0)
    buf.prefetch(held(store, 2))  # waiting behind 1: dropped by close
    errors = []

    def swap():
        try:
            buf.swap_in(1)
        except EngineError as e:
            errors.append(e)

    waiter = threading.Thread(target=swap)
    waiter.start()
    time.sleep(0.05)
    buf.close()
    waiter.join(10)
    assert not waiter.is_alive() and "closed" in str(errors[0])
    read.gate(1).set()  # the read in progress ends, and is never made ready
    buf.thread.join(10)
    assert not buf.thread.is_alive() and buf.ready is None and live_value(model) == before
    assert read.started == [1]
    buf.prefetch(held(store, 3))  # ignored once closed
    assert buf._job is None


def test_the_follower_hands_each_version_to_the_prefetcher_and_again_after_a_swap(store):
    from offpolicy.rollout.swap import VersionFollower

    seen = []
    f = VersionFollower(config(), "", on_version=lambda wv: seen.append(wv.version))
    wv = held(store, 2)
    f._newest = wv  # as _follow sets it
    f.on_version(wv)
    f.offer_newest()
    assert seen == [2, 2] and f.take(2, 0) is wv
    f.offer_newest()  # nothing held now
    assert seen == [2, 2]
    wv.close()


def test_auto_is_off_on_the_cpu_and_explicit_values_stand(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert double_buffered("auto", 1 << 20, cpu) is False
    assert double_buffered(True, 1 << 40, cpu) is True and double_buffered(False, 1, gpu) is False
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 << 30, 80 << 30))
    assert double_buffered("auto", 30 << 30, gpu) is True  # 20 GiB left of 80: a fifth stays free
    assert double_buffered("auto", 40 << 30, gpu) is False  # 10 GiB left: not enough
    assert TorchEngine(config(), seed=0).prefetcher is None  # the default on the CPU


def test_double_buffer_true_needs_the_torch_engine_vllm_servers_or_sglang_in_process():
    with pytest.raises(ConfigError, match="rollout.double_buffer"):
        load_config(QUICKSTART, ["rollout.engine=vllm", "rollout.double_buffer=true"])  # vllm.LLM in process
    with pytest.raises(ConfigError, match="rollout.double_buffer.*mode http"):
        load_config(QUICKSTART, ["rollout.engine=sglang", "rollout.sglang.mode=http",
                                 "rollout.sglang.urls=[http://127.0.0.1:30000]", "rollout.double_buffer=true"])
    load_config(QUICKSTART, ["rollout.engine=vllm", "rollout.vllm.mode=http", "rollout.double_buffer=true"])
    load_config(QUICKSTART, ["rollout.engine=sglang", "model.path=/m", "rollout.double_buffer=true"])  # files ahead


def test_the_follower_gives_up_a_version_the_engine_switched_to_in_flight_and_no_newer_one(store):
    """rollout.inflight_updates: after a generation switched to version v, the swapper takes the follower's held
    version if it is <= v (the engine has it), never a newer one (that one is still to be loaded)."""
    from offpolicy.rollout.swap import VersionFollower

    f = VersionFollower(config(), "")
    wv = held(store, 3)
    f._newest = wv  # as _follow sets it
    assert f.take_through(2) is None and f._newest is wv  # newer than what the engine holds: stays to be loaded
    assert f.take_through(3) is wv and f._newest is None
    wv.close()


def test_a_version_number_published_again_after_a_learner_restart_is_read_again_not_taken_from_the_spare(
        tmp_path, references):
    """A restarted learner republishes a number with other weights: the version read into the spare before the
    restart is read over (its manifest's created_unix differs), never swapped in as the new one."""
    store = WeightStore(str(tmp_path), "restart", keep=10)
    old = build_model(config("model.seed=8").model, torch.device("cpu"))  # what reference 1 is not: seed 7's
    store.publish(1, hf_state(old), hf_config(old))
    engine = TorchEngine(config("rollout.double_buffer=true", "rollout.inflight_updates=false"), seed=0)
    buf = engine.prefetcher
    with held(store, 1) as before:
        buf.prefetch(before)
        poll(lambda: buf.ready == 1, 60.0)  # the abandoned publish of 1, complete in the spare
    store.drop_after(0)  # the learner restarted from its checkpoint at 0 and publishes 1 again
    new = build_model(config("model.seed=7").model, torch.device("cpu"))
    store.publish(1, hf_state(new), hf_config(new))
    with held(store, 1) as again:
        assert again.manifest.created_unix != before.manifest.created_unix
        engine.load(again)
    assert engine.version == 1 and same(engine.generate(PROMPTS, GREEDY), references[1])
    records = buf.drain()
    assert [(r.version, r.outcome) for r in records] == [(1, "superseded"), (1, "swapped")], records
    engine.close()


def test_what_became_of_versions_asked_ahead_of_a_server_s_load():
    """`outcomes` (vLLM's and SGLang's prefetchers): the loaded version is `swapped` with its background work's
    slowest seconds, earliest start and CPU time where every record took one, older ones `superseded`, newer ones
    still asked."""
    from offpolicy.rollout.engines.double_buffer import outcomes

    asked = {1, 2, 3}
    loads = [{"prefetch": {"seconds": 0.5, "began": 10.0, "cpu_seconds": 0.1}},
             {"prefetch": {"seconds": 0.7, "began": 9.0, "cpu_seconds": 0.3}}]
    out = outcomes(asked, 2, loads)
    assert [(r.version, r.outcome) for r in out] == [(1, "superseded"), (2, "swapped")] and asked == {3}
    assert (out[1].seconds, out[1].began, out[1].cpu_seconds) == (0.7, 9.0, 0.3)
    untimed = outcomes({3}, 3, [loads[0], {"prefetch": {"seconds": 0.2, "began": 11.0}}])
    assert untimed[0].outcome == "swapped" and untimed[0].cpu_seconds is None  # one record without it: unknown
    assert outcomes({4}, 4, [loads[0], {}])[0:1] == []  # a record without background work: not swapped from it
    assert not out[1].inflight and out[1].swap_seconds == 0.0
    # vLLM servers switched during a generate call (rollout.inflight_updates): an in-flight load, the servers' longest
    # and each server's load by method and proof, which the daemon counts (a load between calls has none: counted from
    # the engine's last_loads)
    switched = outcomes({5}, 5, [{**loads[0], "seconds": 0.06, "inflight_at": 20.0, "method": "inplace",
                                  "verified": True},
                                 {**loads[1], "seconds": 0.09, "inflight_at": 20.1, "method": "inplace",
                                  "verified": False}])
    assert (switched[0].inflight, switched[0].swapped_at, switched[0].swap_seconds) == (True, 20.0, 0.09)
    assert switched[0].proofs == (("inplace", True), ("inplace", False)) and out[1].proofs == ()
    # a switch in flight that read the version at the load (rollout.vllm.prefetch=direct: nothing ahead) is reported
    # all the same, `unstaged`: the daemon counts and traces it as any switch
    direct = outcomes({6, 7}, 6, [{"seconds": 0.4, "inflight_at": 30.0, "method": "inplace", "verified": True}])
    assert [(r.version, r.outcome, r.inflight, r.swap_seconds, r.proofs) for r in direct] == [
        (6, "unstaged", True, 0.4, (("inplace", True),))]
