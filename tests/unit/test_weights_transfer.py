"""Weight transfer (offpolicy/weights/transfer.py) on the CPU: publish and load through the staged path,
and checksums computed by the writer threads while they write (tests/gpu/test_weights_gpu.py: on a GPU)."""

import hashlib
import os

import pytest
import torch

from offpolicy.weights import WeightStore, WeightVersion
from offpolicy.weights import transfer
from offpolicy.weights.store import read_manifest, sha256_file

RUN = "xfer"


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g).to(torch.float16),
        "model.layers.0.ids": torch.arange(1000, dtype=torch.int64),
        "model.empty": torch.empty(0, 4),
        "lm_head.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
    }


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK", 4096)  # many chunks per tensor, headers between them


def check_version(path, expected):
    manifest = read_manifest(path)
    for name, entry in manifest.files.items():
        assert os.path.getsize(path / name) == entry.bytes
        if manifest.checksum == "sha256":
            assert entry.sha256 == sha256_file(path / name), name
        else:
            assert entry.sha256 == ""
    with WeightVersion(path, verify=True) as wv:
        for name, t in expected.items():
            assert torch.equal(wv.tensors[name], t), name


@pytest.mark.parametrize("checksum", ["sha256", "none"])
def test_publish_writes_the_bytes_and_the_checksums_of_every_shard(tmp_path, small_chunks, checksum):
    store = WeightStore(str(tmp_path), RUN, keep=10, shard_bytes=40_000, checksum=checksum)
    t = tensors()
    store.publish(0, t.items(), {"model_type": "llama"})
    assert len(list((store.dir / "v0").glob("*.safetensors"))) > 1
    check_version(store.dir / "v0", t)


def test_reused_files_of_other_sizes_get_the_right_bytes_and_checksums(tmp_path, small_chunks):
    store = WeightStore(str(tmp_path), RUN, keep=2, shard_bytes=30_000, reuse_files=True)
    for v in range(6):
        t = tensors(seed=v)
        if v % 2:  # other shapes: shard files of other sizes are reused (shrunk or grown)
            t["model.layers.0.ids"] = torch.arange(3000 + v, dtype=torch.int64)
        store.publish(v, t.items(), {})
        check_version(store.dir / f"v{v}", t)


def test_write_files_hashes_while_writing_and_reads_only_the_gaps(tmp_path, small_chunks):
    data = torch.randint(0, 256, (50_000,), dtype=torch.uint8)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 60_000)
        os.pwrite(fd, b"H" * 100, 0)  # a "header" no piece covers; the gap at the end stays zero
        pieces = [(data[20_000:], 20_100), (data[:20_000], 100)]  # out of order: sorted by offset
        (digest,) = transfer.write_files([(fd, 60_000, pieces, True)])
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
        overlapping = [(data[:1000], 0), (data[:1000], 500)]  # cannot be hashed in order: read back
        (digest,) = transfer.write_files([(fd, 60_000, overlapping, True)])
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
        assert path.read_bytes()[500:1500] == data[:1000].numpy().tobytes()
        assert transfer.write_files([(fd, 60_000, pieces, False)]) == [""]
    finally:
        os.close(fd)
    assert path.read_bytes()[100:50_100] == data.numpy().tobytes()


def test_write_files_returns_one_checksum_per_file_in_order(tmp_path, small_chunks):
    files, fds = [], []
    try:
        for i in range(5):
            fd = os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            os.ftruncate(fd, 10_000 + i)
            files.append((fd, 10_000 + i, [(torch.full((10_000,), i, dtype=torch.uint8), i)], i != 2))
        sums = transfer.write_files(files, threads=3)
    finally:
        for fd in fds:
            os.close(fd)
    assert sums[2] == ""
    for i in (0, 1, 3, 4):
        assert sums[i] == hashlib.sha256((tmp_path / f"f{i}").read_bytes()).hexdigest()


def test_load_version_fills_the_destination_and_casts_on_the_way(tmp_path, small_chunks):
    store = WeightStore(str(tmp_path), RUN, shard_bytes=30_000)
    t = tensors()
    store.publish(0, t.items(), {})
    dest = {k: torch.zeros_like(v) for k, v in t.items()}
    dest["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64, dtype=torch.float64)  # cast on the way
    with WeightVersion(store.dir / "v0") as wv:
        transfer.load_version(dest, wv.path)
    for name, v in t.items():
        assert torch.equal(dest[name], v.to(dest[name].dtype)), name


def test_a_traced_profile_keeps_each_stage_interval_and_its_thread(tmp_path, small_chunks):
    import time

    from offpolicy.weights.profile import profile

    t0 = time.perf_counter_ns()
    with profile(trace=True) as p:
        WeightStore(str(tmp_path), RUN, keep=2, checksum="sha256").publish(0, tensors().items(), {"model_type": "llama"})
    t1 = time.perf_counter_ns()
    keys = {key for key, *_ in p.events}
    assert {"write.pwrite", "write.hash", "publish.write"} <= keys
    assert all(t0 <= start <= end <= t1 and thread for _, thread, start, end in p.events)
    pwrite = sum(end - start for key, _, start, end in p.events if key == "write.pwrite") / 1e9
    assert pwrite == pytest.approx(p.seconds["write.pwrite"], rel=1e-3, abs=1e-5)
    with profile() as q:  # untraced: seconds only
        WeightStore(str(tmp_path), RUN + "2", keep=2).publish(0, tensors().items(), {"model_type": "llama"})
    assert q.events is None and q.seconds["write.pwrite"] > 0


def test_the_pool_writes_a_callers_inference_tensors_in_its_inference_mode():
    # vLLM's worker stages a version under torch.inference_mode, so its arena is an inference tensor; the pool's
    # threads start outside that (thread-local) mode, where an in-place write into it raises (an H200's staging
    # to the device: "Inplace update to inference tensor outside InferenceMode is not allowed")
    with torch.inference_mode():
        dst = torch.zeros(8)
        out = transfer._run([(torch.Tensor.add_, dst[i:i + 2], 1.0) for i in range(0, 8, 2)], threads=2)
    assert len(out) == 4 and dst.tolist() == [1.0] * 8
    plain = torch.zeros(4)  # and a caller outside it keeps its own mode: a normal tensor's writes still count
    transfer._run([(torch.Tensor.add_, plain[i:i + 2], 2.0) for i in range(0, 4, 2)], threads=2)
    assert plain.tolist() == [2.0] * 4
