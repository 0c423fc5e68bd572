"""offpolicy/rollout/engines/staging.py (and vllm/where.py): a version's tensors staged for an engine's load (CPU
here: "host" and "device" both stage in this host's memory; page-locking and the GPU's room are checked through their
numbers)."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines import staging
from offpolicy.rollout.engines.staging import ALIGN, Cancelled, Stager, StagingRefused, plan, room
from offpolicy.rollout.engines.vllm.where import resolve

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def version(path, seed=0, scale=1.0):
    """Two shards of mixed dtypes (an empty tensor, odd byte lengths) as a publisher writes them."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({"model.layers.0.w": torch.randn(3, 5, generator=g) * scale, "model.b": torch.randn(7, generator=g).to(
        torch.bfloat16), "model.n": torch.randint(-5, 5, (5,), generator=g, dtype=torch.int8),
        "model.empty": torch.empty(0, 4)}, path / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": torch.randn(33, 17, generator=g) * scale}, path / "model-00002-of-00002.safetensors")
    return path


def files(path):
    out = []
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out += [(name, f.get_tensor(name)) for name in f.keys()]
    return out


def hash_of(tensors):
    return fp.files_fingerprint(tensors, torch.bfloat16)


def test_the_plan_lists_every_tensor_as_vllm_reads_them_each_at_an_aligned_place(tmp_path):
    pieces, nbytes = plan(version(tmp_path / "v"))
    assert [p.name for p in pieces] == [name for name, _ in files(tmp_path / "v")]  # shard by shard, names sorted
    assert all(p.offset % ALIGN == 0 for p in pieces)
    ends = [p.offset + p.nbytes for p in pieces]
    assert all(end <= nxt.offset or nxt.nbytes == 0 or p.nbytes == 0 for p, end, nxt in zip(pieces, ends, pieces[1:]))
    assert nbytes >= max(ends) and nbytes % ALIGN == 0


def test_staged_tensors_are_the_files_tensors_and_their_fingerprint_the_files(tmp_path):
    path = version(tmp_path / "v")
    staged = Stager(CPU).stage(str(path), "host", hash_of)
    want = files(path)
    assert [n for n, _ in staged.tensors] == [n for n, _ in want]
    for (_, t), (_, w) in zip(staged.tensors, want):
        assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w)
    assert staged.files == hash_of(want) and staged.where == "host" and not staged.pinned
    assert [n for n, _ in staged.read(lambda n: n.startswith("model.layers."))] == ["model.layers.0.w"]
    assert staged.record(ahead=True) == {"where": "host", "pinned": False, "bytes": staged.nbytes, "ahead": True,
                                         "read_seconds": staged.read_seconds, "hash_seconds": staged.hash_seconds, "mapped": 0}


@pytest.mark.parametrize("window", [1, 300, 4096, 1 << 20])
def test_windows_read_the_files_tensors_a_window_at_a_time_and_keep_what_is_asked(tmp_path, monkeypatch, window):
    path = version(tmp_path / "v")
    buffers = []
    real = torch.empty
    monkeypatch.setattr(staging.torch, "empty", lambda n, **kw: (
        buffers.append(n) if isinstance(n, int) and kw.get("dtype") is torch.uint8 else None) or real(n, **kw))
    got = list(staging.windows(str(path), CPU, window=window))
    want = files(path)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, t), (_, w) in zip(got, want):
        assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w)
    sizes = sorted(p.nbytes for p in plan(path)[0])
    # each window holds at most `window` bytes, or one larger tensor alone; nothing is read twice
    assert all(n <= max(window, -(-sizes[-1] // ALIGN) * ALIGN) for n in buffers)
    assert sum(buffers) == plan(path)[1]  # every byte read once
    if window >= plan(path)[1]:
        assert len(buffers) == 1
    if window == 1:
        assert len(buffers) == len([n for n in sizes if n])  # a window a tensor (the empty one joins one)
    kept = list(staging.windows(str(path), CPU, keep=lambda n: n.startswith("lm_head"), window=window))
    assert [n for n, _ in kept] == ["lm_head.weight"] and torch.equal(kept[0][1], dict(want)["lm_head.weight"])


def test_one_buffer_serves_every_version_that_fits_and_grows_for_a_larger_one(tmp_path):
    stager = Stager(CPU)
    first = stager.stage(str(version(tmp_path / "a", 1)), "device", hash_of)
    buf = stager.arena.buf
    second = stager.stage(str(version(tmp_path / "b", 2)), "device", hash_of)
    assert stager.arena.buf is buf and second.files == hash_of(files(tmp_path / "b"))
    assert first.tensors[0][1].data_ptr() == second.tensors[0][1].data_ptr()  # the same place: the older is gone
    big = tmp_path / "c"
    big.mkdir()
    save_file({"x": torch.randn(1000, 100)}, big / "model.safetensors")
    third = stager.stage(str(big), "device", hash_of)
    assert stager.arena.buf is not buf and stager.arena.buf.numel() >= third.nbytes
    stager.close()
    assert stager.arena.buf is None


def test_a_newer_staging_stops_the_one_before_and_waits_for_it(tmp_path, monkeypatch):
    stager = Stager(CPU)
    path = str(version(tmp_path / "v"))
    entered, release = threading.Event(), threading.Event()
    real = staging.read_files

    def slow(files, *a, **k):  # the first shard's read of the first staging blocks until released
        if not entered.is_set():
            entered.set()
            assert release.wait(10)
        return real(files, *a, **k)

    monkeypatch.setattr(staging, "read_files", slow)
    first_stop = stager.begin()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("first", _outcome(stager, path, first_stop)))
    t.start()
    assert entered.wait(10)
    second_stop = stager.begin()  # a newer version is asked for: the first is told to stop
    assert first_stop.is_set() and not second_stop.is_set()
    t2 = threading.Thread(target=lambda: out.setdefault("second", _outcome(stager, path, second_stop)))
    t2.start()
    t2.join(0.2)
    assert t2.is_alive()  # it waits for the first to let go of the buffer
    release.set()
    t.join(10)
    t2.join(10)
    assert isinstance(out["first"], Cancelled) and out["second"].files == hash_of(files(tmp_path / "v"))
    third = stager.begin()
    third.set()  # told to stop before it began: no byte is read
    with pytest.raises(Cancelled, match="passed over"):
        stager.stage(path, "host", hash_of, third)


def _outcome(stager, path, stop):
    try:
        return stager.stage(path, "host", hash_of, stop)
    except Cancelled as e:
        return e


def test_auto_stages_on_the_gpu_where_half_its_free_memory_holds_the_version_else_reads_it_there_at_the_load():
    gib = 1 << 30
    assert resolve("auto", CPU, gib, None)[0] == "hash"
    assert resolve("auto", GPU, 5 * gib, 12 * gib)[0] == "device"  # 5 GiB + the reserve in half of 12 GiB
    where, why = resolve("auto", GPU, 6 * gib, 12 * gib)  # 7 GiB: more than half of what is free
    assert where == "direct" and "50%" in why and "a window at a time" in why
    assert resolve("auto", GPU, gib, None)[0] == "direct"  # the free memory unknown
    for setting in ("hash", "host", "device", "direct"):
        assert resolve(setting, CPU, gib, None)[0] == setting
        assert resolve(setting, GPU, 100 * gib, gib)[0] == setting  # an explicit setting is the user's (room() checks)
    with pytest.raises(ValueError, match="rollout.vllm.prefetch"):
        resolve("pinned", GPU, gib, gib)


def test_a_staging_that_does_not_fit_is_refused_naming_the_field_and_the_fix(tmp_path, monkeypatch):
    gib = 1 << 30
    room("device", 2 * gib, GPU, 0, 4 * gib)  # fits beside DEVICE_RESERVE
    with pytest.raises(StagingRefused, match=r"rollout.vllm.prefetch=device.*gpu_memory_utilization.*prefetch=host"):
        room("device", 4 * gib, GPU, 100 * gib, 4 * gib)
    with pytest.raises(StagingRefused, match=r"rollout.vllm.prefetch=host.*prefetch=hash"):
        room("host", 10 * gib, GPU, 10 * gib, None)
    room("device", 10 * gib, CPU, 100 * gib, None)  # the "device" of a CPU worker is host memory
    room("device", 0, GPU, 100 * gib, gib // 2)  # the arena held fits the version: no new byte, nothing to refuse
    sglang = staging.Names("rollout.sglang.prefetch", "rollout.sglang.mem_fraction_static", "disk")
    room("device", 2 * gib, GPU, 0, 6 * gib, sglang, share=0.5)  # an engine's auto: within half of what is free
    with pytest.raises(StagingRefused, match=r"prefetch=auto: .* more than 50% of the 4.00 GiB free .*prefetch=device"):
        room("device", 2 * gib, GPU, 0, 4 * gib, sglang, share=0.5)
    monkeypatch.setattr(staging, "available_host_bytes", lambda: 100)  # this host has no room for the version
    stager = Stager(CPU)
    with pytest.raises(StagingRefused, match="rollout.vllm.prefetch=host"):
        stager.stage(str(version(tmp_path / "v")), "host", hash_of)
    assert stager.arena.buf is None  # refused before anything was allocated


def test_the_gpu_s_free_memory_counts_what_torch_s_allocator_keeps_unused(monkeypatch):
    """A staging's room on a GPU: the driver's free bytes plus the allocator's reserved-but-unallocated ones (freed
    windows and hash chunks it keeps for reuse), plus the arena the stager holds there already."""
    from offpolicy.rollout.engines.staging import Stager, device_free

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 70 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 64 * gib)
    cuda = torch.device("cuda", 0)
    assert device_free(cuda) == 10 * gib
    stager = Stager(cuda)
    monkeypatch.setattr(stager.arena, "held", lambda where: 3 * gib if where == "device" else 0)
    assert stager.free_device() == 13 * gib


def test_a_version_of_several_shards_keeps_every_shard_registered_across_stagings_and_windows(tmp_path):
    """The maps keep `versions` versions registered, a version counted whole: a staging reads shard by shard and a
    direct load window by window, and bounded by one call's bytes (a shard, a window) the cache unregistered the other
    shards after every call and page-locked them again at the next (GPT-OSS-20B's 41.8 GB in shards, each window)."""
    from offpolicy.weights import maps

    path = version(tmp_path / "v")
    calls = []
    cache = maps.MapCache(1, register=lambda ptr, n, *a: calls.append(n), unregister=lambda *a: None, host=True)
    stager, want = Stager(CPU, maps=cache), files(path)
    try:
        for _ in range(4):
            staged = stager.stage(str(path), "host", hash_of)
            assert all(torch.equal(t, w) for (_, t), (_, w) in zip(staged.tensors, want))
        assert len(calls) == 2 and len(cache) == 2  # each shard page-locked once, on its second sighting
        for _ in range(2):
            got = list(staging.windows(str(path), CPU, window=300, maps=cache))
            assert all(torch.equal(t, w) for (_, t), (_, w) in zip(got, want))
        kept = list(staging.windows(str(path), CPU, keep=lambda n: n == "lm_head.weight", window=300, maps=cache))
        assert [n for n, _ in kept] == ["lm_head.weight"]
        assert len(calls) == 2 and cache.evicted == 0
    finally:
        cache.clear()


def test_stagings_and_windows_read_files_met_before_through_their_registered_maps(tmp_path):
    """weights.register_maps: a shard file met again is read out of its page-locked map (on a GPU the copies go
    straight from it, twice the pinned-buffer path's rate), not through the reader's buffers; the tensors are the
    files' either way. Host maps with a fake registration stand in for a GPU's (tests/unit/test_weights_maps.py)."""
    from offpolicy.weights import maps
    from offpolicy.weights.profile import profile

    path = version(tmp_path / "v")
    cache = maps.MapCache(4, register=lambda *a: None, unregister=lambda *a: None, host=True)
    stager, want = Stager(CPU, maps=cache), files(path)
    try:
        direct, mapped = [], []
        for _ in range(3):
            with profile() as p:
                staged = stager.stage(str(path), "host", hash_of)
            direct.append(p.counts.get("files.direct", 0))
            mapped.append(staged.mapped)
            assert [(n, t.dtype, t.shape) for n, t in staged.tensors] == [(n, w.dtype, w.shape) for n, w in want]
            assert all(torch.equal(t, w) for (_, t), (_, w) in zip(staged.tensors, want))
        assert direct == [0, 2, 2]  # met first through the buffers, then both shards through their maps
        assert mapped == [0, p.counts["bytes.direct"], p.counts["bytes.direct"]] and mapped[-1] > 0
        said = staging.staged_said({"staged": staged.record(ahead=True)})
        assert said.endswith(f"({mapped[-1] / 1e9:.3f} GB of it out of registered maps)")
        assert "registered maps" not in staging.staged_said({"staged": {**staged.record(ahead=True), "mapped": 0}})
        with profile() as p:
            got = list(staging.windows(str(path), CPU, window=300, maps=cache))
        assert p.counts.get("files.direct", 0) > 0 and p.counts.get("files.staged", 0) == 0
        assert all(torch.equal(t, w) for (_, t), (_, w) in zip(got, want))
    finally:
        cache.clear()
    assert staging.map_versions(type("W", (), {"keep": 3, "register_maps": True})) == 5
    assert staging.map_versions(type("W", (), {"keep": 3, "register_maps": False})) == 0
    assert staging.reader_maps(5, CPU) is None and staging.reader_maps(0, GPU) is None  # a GPU's alone, when on


def test_a_staging_makes_the_engine_s_ready_tensors_where_they_fit_and_says_so(tmp_path, monkeypatch):
    """`prepare` (vLLM's MXFP4 experts swizzled for their kernels, vllm/kernels.prepare) runs after the read and the
    hash, on the staged tensors; the load takes what it made once. On a GPU without room for them beside the staged
    version nothing is made (the load makes them), said once, naming the setting that makes room."""
    path = str(version(tmp_path / "v"))
    made = []

    def doubled(tensors):
        made.append([n for n, _ in tensors])
        return {n: t * 2 for n, t in tensors if n == "lm_head.weight"}

    prepare = staging.Prepare(doubled, 33 * 17 * 4, "doubled heads")
    staged = Stager(CPU).stage(path, "device", hash_of, prepare=prepare)
    assert made == [[n for n, _ in files(tmp_path / "v")]]
    record = staged.record(ahead=True)
    assert record["prepared"] == 1 and record["prepared_bytes"] == 33 * 17 * 4 and record["unprepared"] is None
    assert "0.000 GB made ready for the kernels in" in staging.staged_said({"staged": record})
    head = dict(staged.tensors)["lm_head.weight"]
    assert torch.equal(staged.take_prepared()["lm_head.weight"], head * 2) and staged.prepared == {}
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled):  # passed over: neither read nor prepared
        Stager(CPU).stage(path, "device", hash_of, stop, prepare)
    assert len(made) == 1

    gib = 1 << 30
    monkeypatch.setattr(staging, "device_free", lambda device: 2 * gib)
    gpu, logged = Stager(GPU), []
    monkeypatch.setattr(staging.log, "warning", lambda msg, *a: logged.append(msg % a))
    for _ in range(2):
        staged = Stager(CPU).stage(path, "host", hash_of)
        gpu._prepare(staged, staging.Prepare(doubled, 4 * gib, "doubled heads"))
        assert staged.prepared == {} and "4.00 GiB of the GPU, which has 2.00 GiB free" in staged.unprepared
    assert len(made) == 1 and len(logged) == 1 and "lower rollout.vllm.gpu_memory_utilization" in logged[0]
    assert "nothing made ready for the kernels (no room)" in staging.staged_said({"staged": staged.record(True)})
