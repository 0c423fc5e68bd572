"""offpolicy/rollout/engines/sglang/staged.py: versions staged for the in-process SGLang engine's tensor loads (on the
CPU here: the arena in host memory), the arena held by a load, and the prefetcher's outcomes. A load through the
stand-in engine: tests/unit/test_sglang_standin_model.py; the daemons: tests/integration/
test_sglang_fingerprint_rehearsal.py."""

from __future__ import annotations

import sys
import types

import torch

import tests.sglang_inprocess as standin
from offpolicy.config import load_config
from offpolicy.rollout.engines.sglang.staged import (StagedLoads, StagedPrefetcher, direct_requests, for_rank,
                                                     prefetch_of, staged_loads, tensor_request, unstaged_of)
from tests.conftest import QUICKSTART
from tests.unit.test_staging import files, version

CPU = torch.device("cpu")


def test_a_staged_version_holds_the_files_tensors_and_a_staging_asked_for_during_a_load_waits_for_it(tmp_path):
    v1, v2 = str(version(tmp_path / "v1", seed=1)), str(version(tmp_path / "v2", seed=2))
    loads = StagedLoads(CPU)
    try:
        loads.prefetch(v1)
        with loads.held(v1) as (staged, ahead):
            assert ahead is not None and ahead.seconds >= 0  # the background's
            got = dict(staged.read())
            loads.prefetch(v2)  # the daemon hears of version 2 while version 1 loads: it must not write the arena now
            assert loads._pending == v2 and loads._ahead.key == v1
            for name, t in files(tmp_path / "v1"):
                assert torch.equal(got[name], t), name  # still version 1's bytes
        with loads.held(v2) as (staged, ahead):  # started when the load of version 1 was over
            assert ahead is not None and {n: t.clone() for n, t in staged.read()}.keys() == got.keys()
            assert all(torch.equal(dict(staged.read())[n], t) for n, t in files(tmp_path / "v2"))
        with loads.held(v1) as (staged, ahead):  # asked for no more: staged at the load, over version 2's
            assert ahead is None and all(torch.equal(dict(staged.read())[n], t) for n, t in files(tmp_path / "v1"))
        with loads.held(v2) as (staged, ahead):  # version 2's staging ahead was overwritten: staged again, not reused
            assert ahead is None and all(torch.equal(dict(staged.read())[n], t) for n, t in files(tmp_path / "v2"))
    finally:
        loads.close()


def test_an_unreadable_version_is_said_once_and_loads_from_disk(tmp_path, caplog):
    loads = StagedLoads(CPU)
    try:
        for _ in range(2):
            with loads.held(str(tmp_path / "gone")) as (staged, ahead):
                assert staged is None and ahead is None
        said = [r.message for r in caplog.records if "loads from disk" in r.message]
        assert len(said) == 1 and "gone" in said[0], said
    finally:
        loads.close()


def test_staging_is_made_only_for_device_loads_into_a_running_engine():
    base = ["model.path=/m", "rollout.engine=sglang"]
    assert staged_loads(load_config(QUICKSTART, base), restart=False) is None  # disk, the default
    device = load_config(QUICKSTART, [*base, "rollout.sglang.prefetch=device"])
    assert staged_loads(device, restart=True) is None  # MXFP4: each version starts an engine from its files
    made = staged_loads(device, restart=False)
    assert made is not None and made.device == CPU  # no GPU here
    made.close()


def test_the_tensor_request_pickles_the_staged_tensors_once_per_tp_rank_with_the_version(tmp_path, monkeypatch):
    for name, module in standin.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    loads = StagedLoads(CPU)
    try:
        with loads.held(str(version(tmp_path / "v"))) as (staged, _):
            req = tensor_request(staged, 2, 7)
            assert req.weight_version == "7" and req.load_format is None and req.flush_cache
            assert len(req.serialized_named_tensors) == 2 and standin.REDUCTIONS_PATCHED
            named = standin.MultiprocessingSerializer.deserialize(req.serialized_named_tensors[1])
            assert [n for n, _ in named] == [n for n, _ in files(tmp_path / "v")]
    finally:
        loads.close()


def test_direct_requests_hand_the_version_a_window_each_and_only_the_last_flushes_and_labels(tmp_path, monkeypatch):
    for name, module in standin.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    path = str(version(tmp_path / "v"))
    want = files(tmp_path / "v")
    reqs = list(direct_requests(path, CPU, 2, 7, window=512))
    assert len(reqs) > 2  # 512-byte windows: several requests
    assert [(r.flush_cache, r.weight_version) for r, _ in reqs] == [(False, None)] * (len(reqs) - 1) + [(True, "7")]
    got = [t for r, _ in reqs for t in standin.MultiprocessingSerializer.deserialize(r.serialized_named_tensors[1])]
    assert all(len(r.serialized_named_tensors) == 2 and r.load_format is None for r, _ in reqs)
    assert [n for n, _ in got] == [n for n, _ in want]  # every tensor once, in the files' order
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(got, want))
    (one, held), = direct_requests(path, CPU, 1, 8)  # DIRECT_WINDOW: the whole version in one request
    assert one.flush_cache and one.weight_version == "8" and [n for n, _ in held] == [n for n, _ in want]
    from offpolicy.weights import maps

    calls = []  # registered maps (host ones here): each shard page-locked once, the version counted whole
    cache = maps.MapCache(1, register=lambda ptr, n, *a: calls.append(n), unregister=lambda *a: None, host=True)
    try:
        for _ in range(3):
            assert len(list(direct_requests(path, CPU, 2, 9, window=512, maps=cache))) == len(reqs)
        assert len(calls) == 2 and cache.evicted == 0
    finally:
        cache.clear()


def test_tp_ranks_share_the_tensors_but_not_those_a_loader_writes_into():
    bias, w = torch.ones(4, 3), torch.ones(4, 3, 5)
    named = [("model.layers.0.mlp.experts.down_proj_bias", bias), ("model.layers.0.mlp.experts.down_proj", w)]
    assert for_rank(named, 0) is named
    (n1, b1), (_, w1) = for_rank(named, 1)
    assert w1 is w and b1 is not bias and b1.data_ptr() != bias.data_ptr() and torch.equal(b1, bias)
    b1.zero_()  # what SGLang's GPT-OSS loader does on MoE-TP ranks other than 0
    assert torch.equal(bias, torch.ones(4, 3))  # rank 0's is untouched


def test_the_prefetcher_reports_the_loaded_version_swapped_and_older_ones_superseded():
    asked: list[str] = []
    loads = types.SimpleNamespace(prefetch=asked.append)
    engine = types.SimpleNamespace(version=-1, last_loads=[])
    p = StagedPrefetcher(loads, engine)
    for v in (1, 2):
        p.prefetch(types.SimpleNamespace(version=v, path=f"/v{v}"))
    assert asked == ["/v1", "/v2"]
    engine.version, engine.last_loads = 2, [{"prefetch": {"seconds": 0.5, "began": 10.0, "waited": 0.0}}]
    assert [(r.version, r.outcome, r.seconds) for r in p.drain()] == [(1, "superseded", 0.0), (2, "swapped", 0.5)]
    assert p.drain() == []
    p.prefetch(types.SimpleNamespace(version=3, path="/v3"))
    engine.version, engine.last_loads = 3, [{}]  # loaded, but staged at the load (the staging ahead failed)
    assert p.drain() == []
    p.close()


def test_the_prefetcher_stages_nothing_while_its_backend_is_not_ready():
    """An MXFP4 engine starts on its first version: nothing is staged before (`LocalBackend.stages_ahead`), as that
    memory would be missing from the KV pool SGLang sizes at its start; versions heard of then load unstaged."""
    asked, ready = [], [False]
    engine = types.SimpleNamespace(version=-1, last_loads=[])
    p = StagedPrefetcher(types.SimpleNamespace(prefetch=asked.append), engine, lambda: ready[0])
    p.prefetch(types.SimpleNamespace(version=0, path="/v0"))
    engine.version, engine.last_loads = 0, [{"method": "start"}]
    assert asked == [] and p.drain() == []
    ready[0] = True
    p.prefetch(types.SimpleNamespace(version=1, path="/v1"))
    engine.version, engine.last_loads = 1, [{"prefetch": {"seconds": 0.3, "began": 1.0, "waited": 0.0}}]
    assert asked == ["/v1"] and [(r.version, r.outcome) for r in p.drain()] == [(1, "swapped")]


def test_auto_stages_on_a_gpu_of_its_own_reads_direct_beside_a_learner_and_else_loads_from_disk(monkeypatch):
    def cfg(*more):
        return load_config(QUICKSTART, ["rollout.engine=sglang", "model.path=/m", "rollout.device=auto", *more])

    assert (prefetch_of(cfg()), unstaged_of(cfg())) == ("disk", "disk")  # the engine on the CPU (the stand-in's)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    own = ["run.learner_gpus=[0]", "run.rollout_gpus=[1]"]
    assert (prefetch_of(cfg(*own)), unstaged_of(cfg(*own))) == ("device", "direct")  # too large to stage: direct
    assert prefetch_of(cfg()) == "device"  # GPUs inherited: nothing known to be shared
    shared = cfg("run.learner_gpus=[0]", "run.rollout_gpus=[0]")
    assert (prefetch_of(shared), unstaged_of(shared)) == ("direct", "direct")  # its free memory is the learner's
    assert prefetch_of(cfg(*own, "rollout.double_buffer=false")) == "direct"  # staged at the load: read twice
    assert prefetch_of(cfg("weights.formats=[fp8]", "rollout.weights_format=fp8")) == "disk"  # low-bit: unmeasured
    assert prefetch_of(cfg("rollout.sglang.dp_size=2")) == "disk"  # tensors go to one replica only
    assert prefetch_of(cfg("rollout.device=cpu")) == "disk"
    assert prefetch_of(cfg("rollout.sglang.mode=http", "rollout.sglang.urls=[http://127.0.0.1:30000]")) == "disk"
    for setting in ("disk", "device", "direct"):
        assert prefetch_of(cfg(f"rollout.sglang.prefetch={setting}")) == setting
    assert unstaged_of(cfg("rollout.sglang.prefetch=disk")) == "disk"  # asked for: never read direct
    device = cfg("rollout.sglang.prefetch=device", "rollout.device=cpu")
    assert unstaged_of(device) == "disk"  # a device staging refused where tensors cannot go: from disk


def test_auto_stages_within_half_the_free_memory_an_explicit_device_within_all_of_it(monkeypatch):
    from offpolicy.rollout.engines.sglang import staged

    monkeypatch.setattr(staged, "from_tensors", lambda cfg: True)
    base = ["model.path=/m", "rollout.engine=sglang", "run.learner_gpus=[0]", "run.rollout_gpus=[1]"]
    for setting, share in (("auto", 0.5), ("device", 1.0)):
        made = staged_loads(load_config(QUICKSTART, [*base, f"rollout.sglang.prefetch={setting}"]), restart=False)
        assert (made.stager.share, made.otherwise) == (share, "direct")
        made.close()
