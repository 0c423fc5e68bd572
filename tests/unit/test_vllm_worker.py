"""offpolicy/rollout/engines/vllm/worker.py against a stand-in vLLM worker (a torch model and a runner whose
`reload_weights` takes a weights iterator or a path, as vLLM 0.26's and 0.32's do; the real servers:
tests/integration/test_vllm_staged.py): which way each in-place load reads the version (rollout.vllm.prefetch), and
that the proof's files half is the version's whichever way."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import types

import pytest
import torch
from safetensors.torch import save_file

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines import staging
from offpolicy.rollout.engines.vllm.worker import Extension, checkpoint_tensors


class Runner:
    """vLLM's model runner as the worker uses it: its model, and an in-place reload from tensors or from a path."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self.calls.append("tensors" if weights_iterator is not None else "path")
        self._load(weights_iterator if weights_iterator is not None else checkpoint_tensors(weights_path, "cpu"))

    def _load(self, tensors):
        params = dict(self.model.named_parameters())
        for name, t in tensors:
            params[name].data.copy_(t)


class OldRunner(Runner):
    """A vLLM whose reload takes no tensors."""

    def reload_weights(self, weights_path=None, is_checkpoint_format=True):
        self.calls.append("path")
        self._load(checkpoint_tensors(weights_path, "cpu"))


class Worker(Extension):
    def __init__(self, runner=Runner):
        torch.manual_seed(0)
        self.model_runner = runner(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
        self.model_config = types.SimpleNamespace(dtype=torch.float32, model="/launch",
                                                  hf_config=types.SimpleNamespace(model_type="llama"))
        self.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1))

    def reload_weights(self, *args, **kwargs):  # vLLM's Worker.reload_weights
        self.model_runner.reload_weights(*args, **kwargs)


@pytest.fixture(autouse=True)
def vllm_config(monkeypatch):
    """The load sets vLLM's current config around the reload: a stand-in module here."""
    monkeypatch.setitem(sys.modules, "vllm.config", types.SimpleNamespace(
        set_current_vllm_config=lambda cfg: contextlib.nullcontext()))


def publish(tmp_path, v):
    g = torch.Generator().manual_seed(v)
    path = tmp_path / f"v{v}"
    path.mkdir()
    shapes = {"0.weight": (16, 8), "0.bias": (16,), "1.weight": (4, 16), "1.bias": (4,)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, path / "model.safetensors")
    return str(path)


def proven(worker, report, path):
    """The report's files half is the version's, and the model's tensors are its tensors."""
    files = fp.files_fingerprint(checkpoint_tensors(path, "cpu"), torch.float32)
    assert int(report["files"]) == files
    assert fp.total(int(v) for v in report["tensors"].values()) == files  # this model holds nothing else


def load(worker, path, stage):
    return json.loads(worker.offpolicy_load(path, "inplace", stage))


def test_without_a_prefetch_a_staging_setting_stages_at_the_load_and_hash_reads_the_files(tmp_path):
    worker = Worker()
    v1, v2 = publish(tmp_path, 1), publish(tmp_path, 2)
    r = load(worker, v1, "host")
    assert worker.model_runner.calls == ["tensors"] and r["staged"]["where"] == "host"
    assert r["staged"]["ahead"] is False and r["staged"]["bytes"] > 0 and "prefetch_seconds" not in r
    proven(worker, r, v1)
    r = load(worker, v2, "hash")
    assert worker.model_runner.calls[-1] == "path" and "staged" not in r
    proven(worker, r, v2)
    r = load(worker, v1, "auto")  # auto on a CPU worker: nothing staged
    assert worker.model_runner.calls[-1] == "path" and "staged" not in r
    proven(worker, r, v1)


def test_a_version_staged_ahead_is_loaded_from_its_tensors_and_another_version_from_its_files(tmp_path):
    worker = Worker()
    v1, v2, v3 = publish(tmp_path, 1), publish(tmp_path, 2), publish(tmp_path, 3)
    assert json.loads(worker.offpolicy_prefetch(v1, "device")) == {"path": v1, "stage": "device"}
    r = load(worker, v1, "device")
    assert worker.model_runner.calls == ["tensors"] and r["staged"]["ahead"] is True
    assert r["prefetch_seconds"] > 0 and r["prefetch_waited"] >= 0
    proven(worker, r, v1)
    worker.offpolicy_prefetch(v2, "device")
    r = load(worker, v3, "device")  # not the version staged: vLLM reads it, the staging ahead is left alone
    assert worker.model_runner.calls[-1] == "path" and "staged" not in r and "prefetch_seconds" not in r
    proven(worker, r, v3)
    r = load(worker, v2, "device")  # ... and still serves its own version's load
    assert worker.model_runner.calls[-1] == "tensors" and r["staged"]["ahead"] is True
    proven(worker, r, v2)
    worker.offpolicy_prefetch(v3, "hash")  # hash: only the files' fingerprint runs ahead
    r = load(worker, v3, "hash")
    assert worker.model_runner.calls[-1] == "path" and "staged" not in r and r["prefetch_seconds"] > 0
    proven(worker, r, v3)


def test_a_staging_reads_with_the_threads_asked_and_the_reader_s_default_for_0(tmp_path, monkeypatch):
    """rollout.vllm.stage_threads reaches the reader of a staging ahead and of one at the load; 0 leaves its default."""
    worker, used = Worker(), []
    read = staging.read_files
    monkeypatch.setattr(staging, "read_files", lambda files, threads=None, **kw: used.append(threads) or read(
        files, threads, **kw))
    v1, v2, v3 = publish(tmp_path, 1), publish(tmp_path, 2), publish(tmp_path, 3)
    worker.offpolicy_prefetch(v1, "host", threads=2)
    proven(worker, json.loads(worker.offpolicy_load(v1, "inplace", "host", threads=2)), v1)
    assert used and set(used) == {2}
    used.clear()
    fresh = Worker()  # no prefetch ever asked of it: a staging setting stages at the load
    proven(fresh, json.loads(fresh.offpolicy_load(v2, "inplace", "host", threads=1)), v2)
    assert used and set(used) == {1}
    used.clear()
    worker.offpolicy_prefetch(v3, "host")
    proven(worker, load(worker, v3, "host"), v3)
    assert used and set(used) == {None}


def test_a_failed_staging_leaves_the_load_to_vllm_and_says_why(tmp_path, monkeypatch):
    worker = Worker()
    v1, v2 = publish(tmp_path, 1), publish(tmp_path, 2)
    monkeypatch.setattr(staging, "available_host_bytes", lambda: 1000)  # no room for the version
    worker.offpolicy_prefetch(v1, "host")
    r = load(worker, v1, "host")
    assert worker.model_runner.calls == ["path"] and "rollout.vllm.prefetch=host" in r["staging_error"]
    proven(worker, r, v1)
    fresh = Worker()
    r = load(fresh, v2, "host")  # at the load too
    assert fresh.model_runner.calls == ["path"] and "StagingRefused" in r["staging_error"]
    proven(fresh, r, v2)


def test_a_vllm_whose_reload_takes_no_tensors_reads_the_files_and_still_takes_the_hash_ahead(tmp_path):
    worker = Worker(OldRunner)
    v1 = publish(tmp_path, 1)
    assert json.loads(worker.offpolicy_prefetch(v1, "host"))["stage"] == "hash"
    r = load(worker, v1, "host")
    assert worker.model_runner.calls == ["path"] and "staged" not in r and r["prefetch_seconds"] > 0
    proven(worker, r, v1)


def test_direct_stages_nothing_and_hands_the_reload_the_files_tensors_read_onto_the_worker_s_device(tmp_path,
                                                                                                     monkeypatch):
    worker = Worker()
    taken = []
    real = worker.model_runner._load
    worker.model_runner._load = lambda tensors: real(taken.append(t.device) or (n, t) for n, t in tensors)
    read = []
    monkeypatch.setattr("offpolicy.rollout.engines.vllm.worker.windows",
                        lambda path, device, keep=None, **kw: read.append((path, device))
                        or staging.windows(path, device, keep, **kw))
    v1, v2 = publish(tmp_path, 1), publish(tmp_path, 2)
    assert json.loads(worker.offpolicy_prefetch(v1, "direct"))["stage"] == "direct"  # nothing ahead, no hash either
    assert worker._offpolicy_ahead is None
    r = load(worker, v1, "direct")
    assert worker.model_runner.calls == ["tensors"] and r["direct"] is True and "staged" not in r
    assert "prefetch_seconds" not in r and read == [(v1, torch.device("cpu"))] and taken  # the worker's device
    assert r["hash_read_seconds"] > 0  # the files' half hashed from what the load read: the files read once
    assert worker._offpolicy_stager().arena.held("host") == 0 == worker._offpolicy_stager().arena.held("device")
    proven(worker, r, v1)
    r = load(worker, v2, "direct")  # no prefetch asked: the same
    assert worker.model_runner.calls[-1] == "tensors" and r["direct"] is True and "prefetch_seconds" not in r
    assert read == [(v1, torch.device("cpu")), (v2, torch.device("cpu"))]
    proven(worker, r, v2)
    old = Worker(OldRunner)
    r = load(old, v1, "direct")  # a vLLM whose reload takes no tensors reads the files itself
    assert old.model_runner.calls == ["path"] and "direct" not in r
    proven(old, r, v1)


class Writing(Runner):
    """A reload whose loader writes into a tensor it is given (vLLM's GPT-OSS zeroes w2_bias on TP ranks but 0), and
    that copies all but `skip` into the model."""

    skip: str | None = None

    def _load(self, tensors):
        params = dict(self.model.named_parameters())
        for name, t in tensors:
            if name == "0.bias":
                t.zero_()
                continue
            if name != self.skip:
                params[name].data.copy_(t)


def test_a_direct_load_hashes_each_tensor_before_the_reload_takes_it_and_reads_what_it_never_took(tmp_path):
    """The files' half of a direct load's proof is the files' own: a tensor the reload writes into was hashed before,
    one the reload never took is read and hashed after it; a tensor it took but did not load fails the proof."""
    worker = Worker(Writing)
    v1, v2 = publish(tmp_path, 1), publish(tmp_path, 2)
    r = load(worker, v1, "direct")
    files = fp.files_fingerprint(checkpoint_tensors(v1, "cpu"), torch.float32)
    assert int(r["files"]) == files  # 0.bias hashed as the file holds it, though the reload zeroed it and kept it
    assert fp.total(int(v) for v in r["tensors"].values()) != files  # ...out of the model: the proof would fail
    worker, took = Worker(), []

    def first_only(tensors):  # a reload that stops after the first tensor: the others are never read by it
        name, t = next(iter(tensors))
        took.append(name)
        dict(worker.model_runner.model.named_parameters())[name].data.copy_(t)

    worker.model_runner._load = first_only
    r = load(worker, v2, "direct")
    assert len(took) == 1 and int(r["files"]) == fp.files_fingerprint(checkpoint_tensors(v2, "cpu"), torch.float32)


def test_auto_reads_direct_where_a_staged_copy_does_not_fit_ahead_or_not(tmp_path, monkeypatch):
    """rollout.vllm.prefetch=auto on a GPU without room for a staged copy (`where.resolve`'s answer there, stood in for
    on this CPU) loads each version a window at a time, whether its hash ran ahead or not; with room it stages."""
    from offpolicy.rollout.engines.vllm import worker as worker_module
    from offpolicy.rollout.engines.vllm.where import resolve

    room = {"fits": False}

    def on_a_gpu(setting, device, nbytes, free):
        if setting != "auto":
            return resolve(setting, device, nbytes, free)
        return ("device", "auto: room") if room["fits"] else ("direct", "auto: no room")

    monkeypatch.setattr(worker_module, "resolve", on_a_gpu)
    worker = Worker()
    v1, v2, v3 = publish(tmp_path, 1), publish(tmp_path, 2), publish(tmp_path, 3)
    assert json.loads(worker.offpolicy_prefetch(v1, "auto"))["stage"] == "direct"
    r = load(worker, v1, "auto")
    assert r["direct"] is True and "staged" not in r and r["hash_read_seconds"] > 0
    assert r["where"] == "direct" and r["where_why"] == "auto: no room", r  # the record says where and why
    proven(worker, r, v1)
    r = load(worker, v2, "auto")  # nothing asked ahead
    assert r["direct"] is True and "staged" not in r and "prefetch_seconds" not in r
    proven(worker, r, v2)
    fresh, headers = Worker(), []  # no background work at all: where is resolved once for the load
    real_header = staging.read_header
    monkeypatch.setattr(staging, "read_header", lambda p: headers.append(str(p)) or real_header(p))
    r = load(fresh, v2, "auto")
    assert r["direct"] is True and len(headers) == 2, headers  # where's plan (the version's bytes), the load's own
    monkeypatch.setattr(staging, "read_header", real_header)
    proven(fresh, r, v2)
    room["fits"] = True
    worker.offpolicy_prefetch(v3, "auto")
    r = load(worker, v3, "auto")
    assert "direct" not in r and r["staged"]["where"] == "device", r
    proven(worker, r, v3)
    # with room but nothing staged ahead (no double buffer, or a version not asked ahead) a staging at the load would
    # read the version and then copy it: auto reads it direct, once
    r = load(Worker(), v2, "auto")
    assert r["direct"] is True and "staged" not in r and "nothing staged ahead" in r["where_why"], r
    worker.offpolicy_prefetch(v1, "auto")  # the background works for another version
    r = load(worker, v2, "auto")
    assert r["direct"] is True and "staged" not in r, r
    proven(worker, r, v2)
    r = load(Worker(), v2, "device")  # asked for: staged at the load
    assert "direct" not in r and r["staged"]["where"] == "device" and not r["staged"]["ahead"], r


class Replayable(torch.nn.Sequential):
    """A model whose own `load_weights` the replay of what the reload misses runs (misses.py), as vLLM's models."""

    def load_weights(self, tensors):
        params = dict(self.named_parameters())
        for name, t in tensors:
            params[name].data.copy_(t)


@pytest.mark.parametrize("stage", ["hash", "host", "direct"])
def test_the_reload_is_not_handed_what_it_misses_and_the_replay_loads_it(tmp_path, monkeypatch, stage):
    """A model type whose reload misses tensors (GPT-OSS's experts and sinks; the biases here): the reload is handed
    every other tensor (with `hash` too, the files read as vLLM reads them), the replay after it loads those, and the
    load is proven."""
    from offpolicy.rollout.engines.vllm import worker as worker_module
    from offpolicy.rollout.engines.vllm.misses import Misses

    monkeypatch.setitem(worker_module.RELOAD_MISSES, "llama", Misses(checkpoint=(".bias",), params=("bias",)))
    worker = Worker()
    torch.manual_seed(0)
    worker.model_runner.model = Replayable(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    v0, v1 = publish(tmp_path, 0), publish(tmp_path, 1)
    worker.model_runner._load(checkpoint_tensors(v0, "cpu"))  # the server started on v0 (vLLM's own load)
    worker.model_config.model = v0  # the replay's layout is checked against it (misses.layout_holds)
    reloaded, headers = [], []
    real = worker.model_runner._load
    worker.model_runner._load = lambda tensors: real(reloaded.append(n) or (n, t) for n, t in tensors)
    real_header = staging.read_header
    monkeypatch.setattr(staging, "read_header", lambda p: headers.append(str(p)) or real_header(p))
    r = load(worker, v1, stage)
    assert r["method"] == "inplace" and "reason" not in r, r
    if stage == "direct":  # the reload and the replay read the version; its headers are read once
        assert len(headers) == 1, headers
    assert worker.model_runner.calls == ["tensors"]  # hash too: the files read for it, less what it misses
    assert sorted(reloaded) == ["0.weight", "1.weight"]
    proven(worker, r, v1)  # the biases too: the replay loaded them


def test_stream_stages_in_host_memory_and_hands_the_reload_each_tensor_on_the_worker_s_device(tmp_path):
    worker = Worker()
    taken = []
    real = worker.model_runner._load
    worker.model_runner._load = lambda tensors: real(taken.append(t.device) or (n, t) for n, t in tensors)
    v1 = publish(tmp_path, 1)
    r = load(worker, v1, "stream")
    assert worker.model_runner.calls == ["tensors"] and r["staged"]["where"] == "host" and r["stream"] is True
    assert taken and all(d == torch.device("cpu") for d in taken)  # the worker's device (a CPU model here)
    proven(worker, r, v1)
    r = load(worker, publish(tmp_path, 2), "host")
    assert "stream" not in r  # host: the reload takes the host tensors themselves


def test_a_rebuild_frees_the_fresh_model_at_once(tmp_path, monkeypatch):
    """The rebuild's fresh model holds reference cycles, as vLLM's do (a parameter's `weight_loader` is its layer's
    bound method): freed only by Python's cyclic collector, which large GPU tensors and few Python objects seldom
    trigger. On an H200 each MXFP4 rebuild so kept a model's worth of GPU memory, and the eighth ran out of memory
    (twenty-third session): the rebuild releases the fresh tensors before it returns, with the collector off."""
    import gc
    import weakref

    fresh_refs, fresh_weight = [], []

    def load_model(vllm_config, model_config):
        torch.manual_seed(1)
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        fresh_weight.append(fresh[0].weight.detach().clone())
        for layer in fresh:
            layer.weight.weight_loader = layer.forward  # a bound method: layer -> weight -> layer
            fresh_refs.extend([weakref.ref(layer.weight), weakref.ref(layer.bias)])
        return fresh

    loader = types.SimpleNamespace(load_model=load_model)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader",
                        types.SimpleNamespace(get_model_loader=lambda load_config: loader))
    worker = Worker()
    worker.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1),
                                               compilation_config=types.SimpleNamespace(static_forward_context={}),
                                               model_config=worker.model_config, load_config=None)
    path = publish(tmp_path, 1)
    gc.disable()  # as a rarely triggered collector would leave things
    try:
        adopted = worker._offpolicy_rebuild(path)
        alive = [ref() is not None for ref in fresh_refs]
    finally:
        gc.enable()
    assert adopted["copied"] == 4 and alive == [False] * 4
    assert torch.equal(worker.model_runner.model[0].weight, fresh_weight[0])  # the running model took its values


def test_ready_says_whether_the_staging_ahead_has_ended_and_progress_counts_each_request(tmp_path, monkeypatch):
    """rollout.inflight_updates: `offpolicy_ready` never waits (it runs between the server's steps); a version never
    asked for, or staging still, is not ready; one asked for "direct" (nothing ahead: the switch's load reads it) is
    ready at once, else a server of prefetch=direct (auto's where no staged copy fits) never switched in flight."""
    worker = Worker()
    v1, v2 = publish(tmp_path, 1), publish(tmp_path, 2)
    assert json.loads(worker.offpolicy_ready(v1)) == {"ready": False}  # nothing asked
    gate = threading.Event()
    stage = staging.Stager.stage
    monkeypatch.setattr(staging.Stager, "stage", lambda *a, **k: (gate.wait(30), stage(*a, **k))[1])
    worker.offpolicy_prefetch(v1, "host")
    assert json.loads(worker.offpolicy_ready(v1)) == {"ready": False}  # staging under way
    gate.set()
    worker._offpolicy_ahead.result(v1)
    assert json.loads(worker.offpolicy_ready(v1)) == {"ready": True}
    assert json.loads(worker.offpolicy_ready(v2)) == {"ready": False}  # another version's
    assert json.loads(worker.offpolicy_prefetch(v2, "direct"))["stage"] == "direct"
    assert json.loads(worker.offpolicy_ready(v2)) == {"ready": True}  # nothing to wait for
    assert json.loads(worker.offpolicy_ready(v1)) == {"ready": False}  # no longer the one asked for
    worker.model_runner.requests = {"0_generate-tokens-offpolicy-ab-0-1f2e3d4c": types.SimpleNamespace(
        output_token_ids=[4, 5, 6])}
    assert json.loads(worker.offpolicy_progress()) == {"0_generate-tokens-offpolicy-ab-0-1f2e3d4c": 3}
