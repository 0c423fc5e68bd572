"""Weight publish and load with the tensors on a real GPU (skipped without one): the staged path
through pinned buffers, with the shards' sha256 computed by the writer threads from the pinned
buffers they just wrote (tests/unit/test_weights_transfer.py covers the same with host tensors), and
the registered path (weights.register_maps: recycled files page-locked once, the GPU copying straight
into and out of their maps; tests/unit/test_weights_maps.py covers the cache without a GPU)."""

from pathlib import Path

import pytest
import torch

from offpolicy.weights import WeightStore, WeightVersion, maps, profile, transfer
from offpolicy.weights.store import read_manifest, sha256_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_tensors(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {f"model.layers.{i}.w": torch.randn(1024, 1536, generator=g, device="cuda").to(torch.bfloat16)
           for i in range(6)}
    out["model.norm.weight"] = torch.randn(1024, generator=g, device="cuda")
    out["model.ids"] = torch.arange(5000, device="cuda")
    out["model.host.weight"] = torch.randn(777, generator=g, device="cuda").cpu()  # a host tensor among GPU ones
    return out


@pytest.mark.parametrize("checksum", ["sha256", "none"])
@pytest.mark.parametrize("reuse", [False, True])
def test_gpu_publish_writes_the_bytes_and_checksums(tmp_path, monkeypatch, checksum, reuse):
    monkeypatch.setattr(transfer, "CHUNK", 1 << 20)  # several chunks (and both slots) per tensor
    store = WeightStore(str(tmp_path), "r", keep=2, shard_bytes=4 << 20, checksum=checksum, reuse_files=reuse)
    for v in range(4):  # with reuse, versions 3+ are written into the files of collected ones
        t = gpu_tensors(seed=v)
        store.publish(v, t.items(), {})
        for name, entry in read_manifest(store.dir / f"v{v}").files.items():
            assert entry.sha256 == (sha256_file(store.dir / f"v{v}" / name) if checksum == "sha256" else ""), name
        with WeightVersion(store.dir / f"v{v}") as wv:
            for name, x in t.items():
                assert torch.equal(wv.tensors[name], x.cpu()), name


def test_gpu_load_fills_the_gpu_tensors(tmp_path):
    store = WeightStore(str(tmp_path), "r", shard_bytes=4 << 20)
    t = {k: v.cuda() for k, v in gpu_tensors().items()}
    store.publish(0, t.items(), {})
    for _ in range(2):  # the second load reuses the pinned slots
        dest = {k: torch.zeros_like(v) for k, v in t.items()}
        with WeightVersion(store.dir / "v0") as wv:
            transfer.load_version(dest, wv.path)
        for name, x in t.items():
            assert torch.equal(dest[name], x), name


# ---------------------------------------------------------------- registered maps (weights.register_maps)
# Stores in /dev/shm, as in a run: Linux page-locks writable shared maps of tmpfs files only (a writable
# map of a file on another filesystem is refused with "invalid argument"; that file takes the staged path).


def check_published(store, v, t, checksum="sha256"):
    path = store.dir / f"v{v}"
    for name, entry in read_manifest(path).files.items():
        assert entry.sha256 == (sha256_file(path / name) if checksum == "sha256" else ""), name
    with WeightVersion(path, verify=checksum == "sha256") as wv:
        for name, x in t.items():
            assert torch.equal(wv.tensors[name], x.cpu()), (v, name)


@pytest.mark.parametrize("checksum", ["sha256", "none"])
def test_gpu_publish_through_registered_maps(shm_root, monkeypatch, checksum):
    """With reuse_files the GPU writes recycled files straight into their page-locked maps: from the
    7th version on (keep=2: v3-v5 take back and register the files of v0-v2) every shard goes direct,
    with the same bytes and sha256 as the staged path writes."""
    monkeypatch.setattr(transfer, "CHUNK", 1 << 20)  # several chunks per file: hashed behind the copies
    store = WeightStore(shm_root, "r", keep=2, shard_bytes=4 << 20, checksum=checksum, reuse_files=True,
                        register_maps=True)
    assert store.maps is maps.shared()
    cache = store.maps = maps.MapCache(4)  # this test's own (the real CUDA registration)
    try:
        for v in range(9):
            t = gpu_tensors(seed=v)
            with profile.profile() as p:
                store.publish(v, t.items(), {})
            check_published(store, v, t, checksum)
            shards = len(list((store.dir / f"v{v}").glob("*.safetensors")))
            direct = p.counts.get("files.direct", 0)
            assert direct == (0 if v < 3 else shards), (v, p.counts)
            assert p.counts.get("maps.registered", 0) == (shards if 3 <= v < 6 else 0), (v, p.counts)
        assert cache.failures == 0 and len(cache) == 3 * shards
        assert all(e.writable for e in cache._entries.values())
        torch.ones(4, device="cuda").add_(1)  # no CUDA error left behind for torch to trip over
        torch.cuda.synchronize()
    finally:
        cache.clear()
    assert len(cache) == 0 and cache.evicted == cache.registered


def test_gpu_publish_through_maps_with_copy_gaps(shm_root, monkeypatch):
    """weights.publish_gap_mib (weights/gaps.py): a tiny kernel on the map stream every gap's bytes leaves the
    bytes as they were; the direct versions count their gaps."""
    monkeypatch.setattr(transfer, "CHUNK", 1 << 20)
    store = WeightStore(shm_root, "r", keep=2, shard_bytes=4 << 20, checksum="sha256", reuse_files=True,
                        register_maps=True, gap_bytes=2 << 20)
    cache = store.maps = maps.MapCache(4)
    try:
        for v in range(7):
            t = gpu_tensors(seed=v)
            with profile.profile() as p:
                store.publish(v, t.items(), {})
            check_published(store, v, t)
            assert (p.counts.get("write.gaps", 0) > 0) == (v >= 3), (v, p.counts)
    finally:
        cache.clear()


def test_gpu_load_through_registered_maps(shm_root):
    """A reader registers a file on its second sighting (read-only map with cudaHostRegisterReadOnly,
    or read-write where the device lacks it) and copies it to the GPU straight from the map."""
    store = WeightStore(shm_root, "r", keep=2, shard_bytes=4 << 20, reuse_files=True)  # staged writer
    cache = maps.MapCache(4)
    try:
        for v in range(7):
            t = gpu_tensors(seed=v)
            store.publish(v, t.items(), {})
            dest = {k: torch.zeros_like(x) for k, x in t.items()}
            dest["model.norm.weight"] = torch.zeros(1024, dtype=torch.float64, device="cuda")  # cast on the way
            with profile.profile() as p, WeightVersion(store.dir / f"v{v}") as wv:
                transfer.load_version(dest, wv.path, maps=cache)
            for name, x in t.items():
                assert torch.equal(dest[name], x.to(dest[name].dtype)), (v, name)
            shards = len(list((store.dir / f"v{v}").glob("*.safetensors")))
            assert p.counts.get("files.direct", 0) == (0 if v < 3 else shards), (v, p.counts)
        assert cache.failures == 0 and len(cache) == 3 * shards
        print(f"read-only registration {'worked' if cache.readonly else 'refused: read-write maps'}")
        (store.dir / "v6").rename(Path(shm_root) / "gone")
        for f in (Path(shm_root) / "gone").iterdir():
            f.unlink()  # deleted files: their maps are unregistered and unmapped at the next sweep
        assert cache.sweep() == shards and len(cache) == 2 * shards
    finally:
        cache.clear()
    assert len(cache) == 0


def test_gpu_publish_and_load_share_one_registration_per_file(shm_root):
    """Writer and reader in one process (the bench): the load uses the writer's read-write maps."""
    store = WeightStore(shm_root, "r", keep=2, shard_bytes=4 << 20, checksum="none", reuse_files=True)
    cache = store.maps = maps.MapCache(4)
    try:
        for v in range(7):
            t = gpu_tensors(seed=v)
            store.publish(v, t.items(), {})
        dest = {k: torch.zeros_like(x) for k, x in t.items()}
        with profile.profile() as p, WeightVersion(store.dir / "v6") as wv:
            transfer.load_version(dest, wv.path, maps=cache)
        assert p.counts.get("files.staged", 0) == 0 and p.counts.get("maps.registered", 0) == 0, p.counts
        assert all(torch.equal(dest[k], x) for k, x in t.items())
    finally:
        cache.clear()


def test_gpu_failed_registration_leaves_no_cuda_error_behind(tmp_path):
    """Registering a read-only map without cudaHostRegisterReadOnly is what failed before (CUDA error 1,
    invalid argument): whatever it returns here, it runs on the registration thread, so torch's next
    kernel-launch check in this thread sees no error."""
    import mmap as mmap_mod

    f = tmp_path / "f"
    f.write_bytes(b"x" * 3149824)
    with open(f, "rb") as fh:
        mm = mmap_mod.mmap(fh.fileno(), 0, access=mmap_mod.ACCESS_READ)
    import numpy as np

    ptr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    err = maps._cuda_register(ptr, len(mm), maps.PORTABLE, torch.device("cuda", torch.cuda.current_device()))
    print(f"read-only map without the read-only flag: {err or 'registered'}")
    if err is None:
        assert maps._cuda_unregister(ptr, torch.device("cuda")) is None
    err = maps._cuda_register(ptr, len(mm), maps.PORTABLE | maps.READ_ONLY, torch.device("cuda"))
    print(f"read-only map with the read-only flag: {err or 'registered'}")
    if err is None:
        assert maps._cuda_unregister(ptr, torch.device("cuda")) is None
    import subprocess

    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    with open(f, "r+b") as fh:
        mw = mmap_mod.mmap(fh.fileno(), 0)  # writable and shared, as the writer maps a recycled shard
    ptr = np.frombuffer(mw, dtype=np.uint8).ctypes.data
    err = maps._cuda_register(ptr, len(mw), maps.PORTABLE, torch.device("cuda"))
    print(f"writable shared map of a file on {fs}: {err or 'registered'}")
    if err is None:
        assert maps._cuda_unregister(ptr, torch.device("cuda")) is None
    torch.ones(4, device="cuda").add_(1)
    torch.cuda.synchronize()
