"""Registered shard maps (offpolicy/weights/maps.py) without a GPU: the cache's keying (second sighting,
by inode), eviction of deleted and resized files, its bound, failures that fall back to the staged
path, fork; the store's size-exact recycling the maps rely on; and the direct (through the map) write
and load paths run on host tensors with a fake registration (`MapCache(host=True)`). Without one, a
store with register_maps on CPU tensors takes the staged path, unchanged. tests/gpu/test_weights_gpu.py
runs the real thing."""

from __future__ import annotations

import logging
import mmap
import os

import pytest
import torch

from offpolicy.weights import WeightStore, WeightVersion, maps, profile, transfer
from offpolicy.weights.store import FREE, read_manifest, sha256_file

from tests.unit.test_weights_transfer import check_version, tensors


class Fake:
    """Stands in for cudaHostRegister / cudaHostUnregister; `fail(flags)` says which calls fail."""

    def __init__(self, fail=lambda flags: False):
        self.registered: dict[int, tuple[int, int]] = {}  # ptr -> (length, flags)
        self.calls, self.unregistered, self.fail = [], [], fail

    def register(self, ptr, length, flags, device):
        self.calls.append((length, flags))
        if self.fail(flags):
            return "CUDA error 1 (invalid argument)"
        assert ptr not in self.registered
        self.registered[ptr] = (length, flags)
        return None

    def unregister(self, ptr, device):
        self.unregistered.append(ptr)
        return None if self.registered.pop(ptr, None) else "not registered"

    def cache(self, versions=5, host=True):
        return maps.MapCache(versions, register=self.register, unregister=self.unregister, host=host)


def make_file(path, size, fill=b"x"):
    path.write_bytes(fill * size)
    return os.open(path, os.O_RDONLY)


def test_a_file_is_registered_on_its_second_sighting_keyed_by_inode(tmp_path):
    fake = Fake()
    cache = fake.cache()
    fd = make_file(tmp_path / "a", 10_000)
    try:
        assert cache.take(fd, "cpu", writable=False) is None  # first sighting: staged, remembered
        assert fake.calls == [] and len(cache) == 0
        e = cache.take(fd, "cpu", writable=False)
        assert e is not None and e.size == 10_000 and not e.writable
        assert fake.calls == [(3 * mmap.PAGESIZE, maps.PORTABLE | maps.READ_ONLY)]  # whole pages, read-only flag
        assert bytes(e.array[:3]) == b"xxx"
        cache.give([e], 10_000)
        again = os.open(tmp_path / "a", os.O_RDONLY)  # another descriptor of the same inode: the same entry
        assert cache.take(again, "cpu", writable=False) is e and len(fake.calls) == 1
        cache.give([e], 10_000)
        os.close(again)
        other = make_file(tmp_path / "b", 100)
        assert cache.take(other, "cpu", writable=False) is None  # another inode: first sighting
        os.close(other)
        w = cache.take(fd, "cpu", writable=True)  # a writer needs a read-write map: registered again
        assert w is not e and w.writable and fake.calls[-1] == (3 * mmap.PAGESIZE, maps.PORTABLE)
        assert fake.unregistered == [e.ptr]
        cache.give([w], 10_000)
        cache.clear()
        assert fake.registered == {} and len(cache) == 0
    finally:
        os.close(fd)


def test_a_registered_map_torch_does_not_see_page_locked_is_said_once(tmp_path, caplog, monkeypatch):
    """A registration that succeeded but left torch's view of the map unpinned (its copies would run at pageable
    speed) is said once a process, for GPU maps; host maps (tests) say nothing."""
    from types import SimpleNamespace

    monkeypatch.setattr(maps, "_unpinned_said", False)
    fake, gpu = Fake(), SimpleNamespace(type="cuda")  # the fake registration pins nothing: torch sees no pinning
    cache = fake.cache()
    fds = [make_file(tmp_path / name, 5000) for name in "abc"]
    try:
        with caplog.at_level(logging.WARNING, logger="offpolicy.weights"):
            assert cache.take(fds[0], "cpu", writable=False) is None
            cache.give([cache.take(fds[0], "cpu", writable=False)], 5000)
            assert "not page-locked" not in caplog.text  # a host map
            for fd in fds[1:]:
                assert cache.take(fd, gpu, writable=False) is None
                cache.give([cache.take(fd, gpu, writable=False)], 5000)
        assert caplog.text.count("not page-locked as torch sees it") == 1 and len(fake.calls) == 3
    finally:
        cache.clear()
        for fd in fds:
            os.close(fd)


def seen_twice(cache, path, writable=False):
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        assert cache.take(fd, "cpu", writable) is None
        e = cache.take(fd, "cpu", writable)
        assert e is not None
        return e
    finally:
        os.close(fd)


def test_entries_of_deleted_or_resized_files_are_unregistered_and_unmapped(tmp_path):
    fake = Fake()
    cache = fake.cache()
    for name in "abc":
        make_file(tmp_path / name, 5000)
    a, b, c = (seen_twice(cache, tmp_path / n) for n in "abc")
    cache.give([a, b, c], 15_000)
    assert cache.sweep() == 0 and len(cache) == 3
    (tmp_path / "a").unlink()  # deleted: its pages must not stay pinned
    os.truncate(tmp_path / "b", 4000)  # resized: its pinned pages may no longer be the file's
    assert cache.sweep() == 2
    assert set(fake.unregistered) == {a.ptr, b.ptr} and len(cache) == 1 and c.key in cache._entries
    with pytest.raises(OSError):
        os.fstat(a.fd)  # its descriptor is closed: the inode can go
    fd = os.open(tmp_path / "b", os.O_RDONLY)
    e = cache.take(fd, "cpu", False)  # seen before: registered again at its new size
    assert e is not None and e.size == 4000
    cache.give([e], 4000)
    os.close(fd)


def test_an_entry_in_use_is_never_evicted(tmp_path):
    fake = Fake()
    cache = fake.cache(versions=1)
    make_file(tmp_path / "a", 5000)
    e = seen_twice(cache, tmp_path / "a")
    (tmp_path / "a").unlink()
    assert cache.sweep() == 0 and len(cache) == 1  # a copy may still run through it
    cache.give([e], 5000)
    assert cache.sweep() == 1 and fake.registered == {}


def test_the_cache_keeps_versions_times_the_largest_call_least_recently_used_out_first(tmp_path):
    fake = Fake()
    cache = fake.cache(versions=2)
    entries = []
    for i in range(5):
        make_file(tmp_path / f"f{i}", 1000)
        entries.append(seen_twice(cache, tmp_path / f"f{i}"))
        cache.give([entries[-1]], 1000)  # a "version" of one 1000-byte file: two of them fit
    assert len(cache) == 2 and cache.bytes == 2000
    assert [e.key for e in cache._entries.values()] == [entries[3].key, entries[4].key]
    assert set(fake.unregistered) == {e.ptr for e in entries[:3]}
    fd = os.open(tmp_path / "f3", os.O_RDONLY)
    e3 = cache.take(fd, "cpu", False)  # used again: now the most recent
    cache.give([e3], 1000)
    os.close(fd)
    make_file(tmp_path / "f5", 1000)
    cache.give([seen_twice(cache, tmp_path / "f5")], 1000)
    f5 = os.stat(tmp_path / "f5")
    assert {e.key for e in cache._entries.values()} == {entries[3].key, (f5.st_dev, f5.st_ino)}


def test_a_failed_registration_warns_once_falls_back_and_the_process_gives_up_after_a_few(tmp_path, caplog):
    fake = Fake(fail=lambda flags: True)
    cache = fake.cache()
    caplog.set_level(logging.DEBUG, logger="offpolicy.weights")
    for i in range(maps.MAX_FAILURES + 2):
        make_file(tmp_path / f"f{i}", 3000)
        fd = os.open(tmp_path / f"f{i}", os.O_RDONLY)
        assert cache.take(fd, "cpu", False) is None
        assert cache.take(fd, "cpu", False) is None  # second sighting: registration fails, staged
        assert cache.take(fd, "cpu", False) is None  # not tried again for that file
        os.close(fd)
    assert cache.failures == maps.MAX_FAILURES and not cache.enabled
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "staged path" in warnings[0].getMessage()
    assert "invalid argument" in warnings[0].getMessage()
    # read-only then read-write per file until the device refused the read-only flag once
    assert fake.calls[:3] == [(mmap.PAGESIZE, maps.PORTABLE | maps.READ_ONLY), (mmap.PAGESIZE, maps.PORTABLE),
                              (mmap.PAGESIZE, maps.PORTABLE)]
    assert len(fake.calls) == maps.MAX_FAILURES + 1  # nothing tried once the cache gave up
    assert len(cache) == 0


def test_a_device_without_read_only_registration_gets_read_write_maps(tmp_path):
    fake = Fake(fail=lambda flags: bool(flags & maps.READ_ONLY))
    cache = fake.cache()
    make_file(tmp_path / "a", 3000)
    os.chmod(tmp_path / "a", 0o600)
    e = seen_twice(cache, tmp_path / "a")
    assert e.writable and cache.readonly is False and cache.failures == 0
    cache.give([e], 3000)


def test_registration_that_raises_is_a_failure_not_an_error(tmp_path):
    def boom(*args):
        raise AssertionError("Torch not compiled with CUDA enabled")

    cache = maps.MapCache(register=boom, unregister=boom)
    fd = make_file(tmp_path / "a", 3000)
    assert cache.take(fd, "cpu", False) is None and cache.take(fd, "cpu", False) is None
    assert cache.failures == 1
    os.close(fd)


def test_a_forked_child_forgets_the_parents_maps_without_unregistering(tmp_path):
    fake = Fake()
    cache = fake.cache()
    make_file(tmp_path / "a", 3000)
    cache.give([seen_twice(cache, tmp_path / "a")], 3000)
    pid = os.fork()
    if pid == 0:  # the child: no entries, and no unregister call was made for them
        os._exit(0 if len(cache) == 0 and fake.unregistered == [] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(cache) == 1  # the parent's stay
    cache.clear()


# ---------------------------------------------------------------- the store and the copy paths


def test_recycled_files_are_never_resized_and_the_pool_stays_bounded(tmp_path, monkeypatch):
    from offpolicy.weights import store as store_mod

    monkeypatch.setattr(store_mod, "FREE_FILES", 5)
    store = WeightStore(str(tmp_path), "r", keep=2, shard_bytes=30_000, reuse_files=True)
    sizes: dict[int, int] = {}
    recycled = 0
    for v in range(8):
        t = tensors(seed=v)
        if v % 3 == 1:  # other shapes now and then: no file of that size in the pool
            t["model.layers.0.ids"] = torch.arange(3000 + v, dtype=torch.int64)
        store.publish(v, t.items(), {})
        for f in (store.dir / f"v{v}").glob("*.safetensors"):
            st = f.stat()
            if st.st_ino in sizes:
                recycled += 1
                assert sizes[st.st_ino] == st.st_size, f"{f} was resized"
            sizes[st.st_ino] = st.st_size
        check_version(store.dir / f"v{v}", t)
        assert len(list((store.dir / FREE).iterdir())) <= 5 if (store.dir / FREE).exists() else True
    assert recycled > 0


def host_store(tmp_path, fake, checksum="sha256"):
    store = WeightStore(str(tmp_path), "r", keep=2, shard_bytes=30_000, checksum=checksum, reuse_files=True)
    store.maps = fake.cache(versions=4)  # host=True: host tensors go through the maps as GPU ones would
    return store


@pytest.mark.parametrize("checksum", ["sha256", "none"])
def test_publish_through_registered_maps_writes_the_bytes_and_checksums(tmp_path, monkeypatch, checksum):
    monkeypatch.setattr(transfer, "CHUNK", 4096)  # many chunks per file, hashed behind the copies
    fake = Fake()
    store = host_store(tmp_path, fake, checksum)
    direct = []
    for v in range(8):
        t = tensors(seed=v)
        with profile.profile() as p:
            store.publish(v, t.items(), {})
        direct.append(p.counts.get("files.direct", 0))
        check_version(store.dir / f"v{v}", t)  # sizes, sha256 (recomputed from the files), bytes
        for name, entry in read_manifest(store.dir / f"v{v}").files.items():
            assert entry.sha256 == (sha256_file(store.dir / f"v{v}" / name) if checksum == "sha256" else "")
    shards = len(list((store.dir / "v7").glob("*.safetensors")))
    # v0-v2 are fresh files, v3-v5 take theirs back (second sighting: registered, already direct)
    assert direct[:3] == [0, 0, 0] and direct[3:] == [shards] * 5
    assert len(store.maps) == 3 * shards and fake.registered and store.maps.registered == 3 * shards


def test_load_through_registered_maps_fills_the_destination(tmp_path):
    fake = Fake()
    store = WeightStore(str(tmp_path), "r", keep=2, shard_bytes=30_000, reuse_files=True)
    cache = fake.cache(versions=4)
    for v in range(6):
        t = tensors(seed=v)
        store.publish(v, t.items(), {})
        dest = {k: torch.zeros_like(x) for k, x in t.items()}
        dest["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64, dtype=torch.float64)  # cast on the way
        with profile.profile() as p, WeightVersion(store.dir / f"v{v}") as wv:
            transfer.load_version(dest, wv.path, maps=cache)
        for name, x in t.items():
            assert torch.equal(dest[name], x.to(dest[name].dtype)), (v, name)
        assert bool(p.counts.get("files.direct")) == (v >= 3)  # the reader met v0's files in v3
    assert all(flags == maps.PORTABLE | maps.READ_ONLY for _, flags in fake.registered.values())


def test_without_cuda_register_maps_leaves_the_staged_path_unchanged(tmp_path):
    store = WeightStore(str(tmp_path), "r", keep=2, shard_bytes=30_000, reuse_files=True, register_maps=True)
    assert store.maps is maps.shared()
    before = (store.maps.registered, store.maps.failures, len(store.maps))
    for v in range(5):
        t = tensors(seed=v)
        with profile.profile() as p:
            store.publish(v, t.items(), {})
            dest = {k: torch.zeros_like(x) for k, x in t.items()}
            with WeightVersion(store.dir / f"v{v}") as wv:
                transfer.load_version(dest, wv.path, maps=store.maps)
        check_version(store.dir / f"v{v}", t)
        assert all(torch.equal(dest[k], x) for k, x in t.items())
        assert "files.direct" not in p.counts and p.counts["files.staged"] > 0
    assert (store.maps.registered, store.maps.failures, len(store.maps)) == before  # nothing even tried
    assert WeightStore(str(tmp_path), "s", register_maps=True).maps is None  # without reuse_files: no cache


def test_copies_wait_for_the_producers_event_alone_when_given():
    """A background writer's copies wait for the event recorded once its sources were made, not for the whole
    stream they were made on (where the learner queues its next step meanwhile); without one, for that stream."""
    from offpolicy.weights.maps import copies_after

    class Stream:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(("event", event))

        def wait_stream(self, stream):
            self.waited.append(("stream", stream))

    s, producer = Stream(), object()
    copies_after(s, "made", producer)
    copies_after(s, None, producer)
    assert s.waited == [("event", "made"), ("stream", producer)]


def test_host_pieces_need_no_event():
    import torch

    from offpolicy.weights.sharded import _made

    assert _made([torch.zeros(4), torch.ones(2)]) is None
    assert _made([]) is None


class _Flag:
    """A stand-in for the one-byte CUDA tensor `gaps.CopyGaps` writes: counts the kernels."""

    def __init__(self):
        self.kernels = 0

    def add_(self, _):
        self.kernels += 1


def test_copy_gaps_go_between_copies_every_so_many_bytes():
    from offpolicy.weights.gaps import CopyGaps

    flag = _Flag()
    gaps = CopyGaps(100, flag)
    device = torch.device("cuda", 0)  # never touched: the flag is given
    for n in (60, 30, 10, 250, 1, 99, 1, 5):  # a gap before a copy once >= 100 bytes went since the last
        gaps.before(n, device)
    # 60 30 10 | 250 | 1 99 | 1 5: gaps before the 250, the first 1 and the second 1
    assert flag.kernels == gaps.count == 3 and gaps.since == 6
    none = CopyGaps(0, flag)
    for _ in range(10):
        none.before(1 << 30, device)
    assert none.count == 0 and flag.kernels == 3


def test_the_publish_gap_reaches_every_store_and_writer(tmp_path):
    from offpolicy.config import WeightsConfig
    from offpolicy.weights.publisher import Publisher

    w = WeightsConfig(root=str(tmp_path), formats=["fp8"])
    assert w.publish_gap_mib == 32
    assert {s.gap_bytes for s in Publisher(w, "g").stores.values()} == {32 << 20}
    w0 = WeightsConfig(root=str(tmp_path), publish_gap_mib=0)
    assert {s.gap_bytes for s in Publisher(w0, "g0").stores.values()} == {0}
