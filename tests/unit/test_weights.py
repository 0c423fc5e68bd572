"""Tests for offpolicy.weights: the versioned store (layout, modes, sharding, atomicity, GC under
readers in other processes), `WeightVersion` (zero-copy views, verification), the safetensors view,
loading a published version with HF `transformers`, and the `subscribe` API (store scan and a real
ZeroMQ PUB socket)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import queue
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from safetensors.torch import load_file, save_file

from offpolicy.config import load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.wire import protocol
from offpolicy.weights import (
    ChecksumError,
    Manifest,
    Published,
    WeightStore,
    WeightVersion,
    list_versions,
    subscribe,
    version_dir,
)
from offpolicy.weights.safetensors_view import map_tensors, read_header
from offpolicy.weights.store import INDEX, MANIFEST

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
RUN = "unit"


def small_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def publish(store: WeightStore, version: int, tensors: dict[str, torch.Tensor] | None = None,
            config: dict | None = None) -> Published:
    tensors = small_tensors(version) if tensors is None else tensors
    return store.publish(version, iter(tensors.items()), config or {"model_type": "llama", "v": version})


def hidden_entries(run_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(run_dir) if e.name.startswith("."))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- publish: layout, manifest, modes


def test_publish_writes_version_dir_with_shards_index_config_and_manifest(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    tensors = small_tensors()
    config = {"model_type": "llama", "hidden_size": 8, "nested": {"a": [1, 2]}, "architectures": ["LlamaForCausalLM"]}
    pub = store.publish(3, iter(tensors.items()), config)

    vdir = tmp_path / RUN / "v3"
    assert pub.version == 3 and Path(pub.path) == vdir == version_dir(tmp_path, RUN, 3)
    assert pub.seconds >= 0
    expected_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert pub.total_bytes == expected_bytes
    shard = "model-00001-of-00001.safetensors"
    assert sorted(os.listdir(vdir)) == sorted([shard, INDEX, "config.json", MANIFEST])

    assert json.loads((vdir / "config.json").read_text()) == config
    index = json.loads((vdir / INDEX).read_text())
    assert index["metadata"]["total_size"] == expected_bytes
    assert index["weight_map"] == {name: shard for name in tensors}

    manifest = msgspec.json.decode((vdir / MANIFEST).read_bytes(), type=Manifest)
    assert manifest.version == 3
    assert manifest.num_tensors == len(tensors)
    assert manifest.total_bytes == expected_bytes
    assert manifest.checksum == "sha256"
    assert abs(manifest.created_unix - time.time()) < 60
    assert sorted(manifest.files) == sorted([shard, INDEX, "config.json"])  # all but the manifest itself
    for name, entry in manifest.files.items():
        assert entry.bytes == (vdir / name).stat().st_size
        assert entry.sha256 == sha256(vdir / name)

    loaded = load_file(str(vdir / shard))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t)
    assert list_versions(tmp_path, RUN) == [3]


def test_directories_are_0700_and_files_0600(tmp_path):
    store = WeightStore(str(tmp_path), RUN, shard_bytes=600)  # several shards
    pub = publish(store, 0)
    run_dir = tmp_path / RUN
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    vdir = Path(pub.path)
    assert stat.S_IMODE(vdir.stat().st_mode) == 0o700
    files = list(vdir.iterdir())
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1
    for f in files:
        assert f.is_file()
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_existing_run_dir_is_tightened_to_0700(tmp_path):
    (tmp_path / RUN).mkdir(mode=0o755)
    os.chmod(tmp_path / RUN, 0o755)
    WeightStore(str(tmp_path), RUN)
    assert stat.S_IMODE((tmp_path / RUN).stat().st_mode) == 0o700


def test_checksum_none_records_sizes_but_no_hashes(tmp_path):
    store = WeightStore(str(tmp_path), RUN, checksum="none")
    pub = publish(store, 0)
    with WeightVersion(pub.path, verify=True) as wv:
        assert wv.manifest.checksum == "none"
        for name, entry in wv.manifest.files.items():
            assert entry.sha256 == ""
            assert entry.bytes == (Path(pub.path) / name).stat().st_size


# ---------------------------------------------------------------- sharding


def test_sharding_by_shard_bytes_gives_consistent_index(tmp_path):
    shard_bytes = 1 << 20
    g = torch.Generator().manual_seed(1)
    tensors = {f"model.layers.{i}.weight": torch.randn(150_000, generator=g) for i in range(5)}  # 600 KB each
    tensors["model.norm.weight"] = torch.randn(1000, generator=g)  # 4 KB: fits beside a big one
    tensors["model.layers.5.weight"] = torch.randn(300_000, generator=g)  # 1.2 MB: alone, over the limit
    tensors["lm_head.weight"] = torch.randn(1000, generator=g)
    store = WeightStore(str(tmp_path), RUN, shard_bytes=shard_bytes)
    pub = publish(store, 0, tensors)
    vdir = Path(pub.path)

    shards = sorted(p.name for p in vdir.glob("*.safetensors"))
    n = len(shards)
    assert n == 7
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    index = json.loads((vdir / INDEX).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)  # every shard is referenced
    total = 0
    for fname in shards:
        header, _ = read_header(vdir / fname)
        names = [k for k in header if k != "__metadata__"]
        assert names, fname
        nbytes = sum(tensors[k].numel() * tensors[k].element_size() for k in names)
        assert nbytes <= shard_bytes or len(names) == 1  # only a single oversize tensor may exceed it
        total += nbytes
        for k in names:
            assert index["weight_map"][k] == fname
    assert index["metadata"]["total_size"] == total == pub.total_bytes

    with WeightVersion(vdir, verify=True) as wv:
        assert wv.manifest.num_tensors == len(tensors)
        assert set(wv.manifest.files) == set(shards) | {INDEX, "config.json"}
        assert wv.tensors.keys() == tensors.keys()
        for k, t in tensors.items():
            assert torch.equal(wv.tensors[k], t)


# ---------------------------------------------------------------- atomicity, sweep, existing versions


def test_failed_publish_leaves_no_version_and_no_temp_dir(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    tensors = small_tensors()

    def broken():
        first = next(iter(tensors.items()))
        yield first
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        store.publish(7, broken(), {"model_type": "llama"})
    run_dir = tmp_path / RUN
    assert not (run_dir / "v7").exists()
    assert hidden_entries(run_dir) == []
    assert list_versions(tmp_path, RUN) == []

    # the same version can be published afterwards
    pub = store.publish(7, iter(tensors.items()), {"model_type": "llama"})
    with WeightVersion(pub.path, verify=True) as wv:
        assert wv.tensors.keys() == tensors.keys()
    assert hidden_entries(run_dir) == []


def test_failed_config_write_leaves_no_version_and_no_temp_dir(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    with pytest.raises(TypeError):  # not JSON-serialisable: fails after the shards are written
        store.publish(1, iter(small_tensors().items()), {"model_type": "llama", "bad": object()})
    assert not (tmp_path / RUN / "v1").exists()
    assert hidden_entries(tmp_path / RUN) == []


def test_leftover_hidden_dirs_are_swept_when_a_store_is_created(tmp_path):
    run_dir = tmp_path / RUN
    run_dir.mkdir()
    leftover = run_dir / ".v7.tmp-123"
    leftover.mkdir()
    (leftover / "model-00001-of-00001.safetensors").write_bytes(b"half written")
    (run_dir / ".v2.gc-456").mkdir()
    (run_dir / "notes.txt").write_text("not ours")
    WeightStore(str(tmp_path), RUN)
    assert not leftover.exists()
    assert not (run_dir / ".v2.gc-456").exists()
    assert (run_dir / "notes.txt").read_text() == "not ours"


def test_publishing_an_existing_version_raises_and_keeps_the_old_one(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    first = publish(store, 4)
    before = (Path(first.path) / MANIFEST).read_bytes()
    with pytest.raises(FileExistsError):
        publish(store, 4, small_tensors(99))
    assert (Path(first.path) / MANIFEST).read_bytes() == before
    with WeightVersion(first.path, verify=True) as wv:
        assert torch.equal(wv.tensors["lm_head.weight"], small_tensors(4)["lm_head.weight"])
    assert hidden_entries(tmp_path / RUN) == []


def test_list_versions_ignores_incomplete_and_foreign_entries(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    for v in (0, 2, 10):
        publish(store, v)
    (tmp_path / RUN / "v5").mkdir()  # no manifest: not a complete version
    (tmp_path / RUN / "vx").mkdir()
    (tmp_path / RUN / "v11.tmp").mkdir()
    assert list_versions(tmp_path, RUN) == [0, 2, 10]  # numeric, not lexical order
    assert list_versions(tmp_path, "no-such-run") == []


# ---------------------------------------------------------------- garbage collection


def test_gc_keeps_the_newest_keep_versions(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=2)
    for v in range(5):
        publish(store, v)
        assert list_versions(tmp_path, RUN) == list(range(max(0, v - 1), v + 1))
    assert sorted(os.listdir(tmp_path / RUN)) == ["v3", "v4"]  # no .gc leftovers
    assert store.collect() == []


def test_reuse_files_writes_new_versions_into_the_shards_of_collected_ones(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=2, shard_bytes=1 << 20, reuse_files=True)
    big = {f"model.layers.{i}.weight": torch.randn(200_000) for i in range(3)}  # 800 KB each: 3 shards
    inodes = set()
    for v in range(6):
        tensors = {k: t + v for k, t in big.items()}
        pub = publish(store, v, tensors)
        shards = sorted(Path(pub.path).glob("*.safetensors"))
        if v >= 3:  # v0 is collected by the publish of v2: its files serve v3 on
            assert {f.stat().st_ino for f in shards} <= inodes
            assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in shards)
        inodes |= {f.stat().st_ino for f in shards}
        with WeightVersion(pub.path, verify=True) as wv:
            assert all(torch.equal(wv.tensors[k], t) for k, t in tensors.items())
        assert load_file(str(shards[0])).keys() <= tensors.keys()  # still valid safetensors
    assert list_versions(tmp_path, RUN) == [4, 5]
    assert sorted(os.listdir(tmp_path / RUN)) == [".free", "v4", "v5"]


def test_gc_skips_a_version_held_in_this_process_until_closed(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1)
    publish(store, 0)
    wv = WeightVersion(version_dir(tmp_path, RUN, 0))
    publish(store, 1)
    publish(store, 2)
    assert list_versions(tmp_path, RUN) == [0, 2]
    wv.close()
    wv.close()  # idempotent
    assert store.collect() == [0]
    assert list_versions(tmp_path, RUN) == [2]


def test_tensors_stay_valid_after_their_version_is_collected(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1)
    publish(store, 0)
    with WeightVersion(version_dir(tmp_path, RUN, 0)) as wv:
        tensors = wv.tensors
    publish(store, 1)
    assert not version_dir(tmp_path, RUN, 0).exists()
    for k, t in small_tensors(0).items():
        assert torch.equal(tensors[k], t)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see the xfail below
def test_opening_a_collected_version_raises_file_not_found(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1)
    publish(store, 0)
    publish(store, 1)
    with pytest.raises(FileNotFoundError):
        WeightVersion(version_dir(tmp_path, RUN, 0))


def test_failed_open_of_a_missing_version_raises_nothing_from_its_destructor(tmp_path, monkeypatch):
    caught = []
    monkeypatch.setattr(sys, "unraisablehook", caught.append)
    with pytest.raises(FileNotFoundError):
        WeightVersion(tmp_path / RUN / "v0")
    gc.collect()
    assert [repr(u.exc_value) for u in caught] == []


READER = """
import sys, time
from offpolicy.weights import WeightVersion
wv = WeightVersion(sys.argv[1])
assert float(sum(t.float().sum() for t in wv.tensors.values())) == float(sys.argv[2])
print("ready", wv.version, flush=True)
time.sleep(120)
"""


def test_gc_skips_a_version_held_by_a_reader_in_another_process(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=2)
    publish(store, 0)
    checksum = float(sum(t.float().sum() for t in small_tensors(0).values()))
    reader = subprocess.Popen([sys.executable, "-c", READER, str(version_dir(tmp_path, RUN, 0)), repr(checksum)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = reader.stdout.readline()
        assert line.split() == ["ready", "0"], (line, reader.stderr.read() if reader.poll() is not None else "")

        for v in range(1, 5):
            t0 = time.monotonic()
            publish(store, v)
            assert time.monotonic() - t0 < 10  # the collector never waits for a reader
        assert list_versions(tmp_path, RUN) == [0, 3, 4]  # the held one survives, the others go
        with WeightVersion(version_dir(tmp_path, RUN, 0), verify=True) as wv:
            assert torch.equal(wv.tensors["lm_head.weight"], small_tensors(0)["lm_head.weight"])
    finally:
        reader.send_signal(signal.SIGKILL)
        reader.wait(timeout=30)
        reader.stdout.close()
        reader.stderr.close()
    # the kernel drops a dead reader's lock: the next publish collects it
    publish(store, 5)
    assert list_versions(tmp_path, RUN) == [4, 5]
    assert sorted(os.listdir(tmp_path / RUN)) == ["v4", "v5"]


# ---------------------------------------------------------------- WeightVersion: zero-copy views


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == str(path):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_tensors_are_views_on_a_map_of_the_shard(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    pub = publish(store, 0)
    shard = (Path(pub.path) / "model-00001-of-00001.safetensors").resolve()
    with WeightVersion(pub.path) as wv:
        tensors = wv.tensors
        ranges = _mapped_ranges(shard)
        assert ranges, "the shard is not memory-mapped"
        for name, t in tensors.items():
            ptr = t.untyped_storage().data_ptr()
            assert any(lo <= ptr and ptr + t.numel() * t.element_size() <= hi for lo, hi in ranges), name
        assert tensors is wv.tensors  # mapped once, on first access


def test_two_readers_see_the_same_data_and_writes_stay_private(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    pub = publish(store, 0)
    expected = small_tensors(0)
    shard = Path(pub.path) / "model-00001-of-00001.safetensors"
    digest = sha256(shard)
    a, b = WeightVersion(pub.path), WeightVersion(pub.path)
    try:
        for k, t in expected.items():
            assert torch.equal(a.tensors[k], t) and torch.equal(b.tensors[k], t)
        a.tensors["lm_head.weight"].fill_(123.0)  # copy-on-write: only this reader's map changes
        assert torch.all(a.tensors["lm_head.weight"] == 123.0)
        assert torch.equal(b.tensors["lm_head.weight"], expected["lm_head.weight"])
    finally:
        a.close()
        b.close()
    assert sha256(shard) == digest
    with WeightVersion(pub.path, verify=True) as c:
        assert torch.equal(c.tensors["lm_head.weight"], expected["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool])
def test_map_tensors_round_trips_dtypes_exactly(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        base = torch.randn(5, 7, generator=g) * 1e3
        base[0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
        t = base.to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(5, 7, generator=g) > 0.5
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (5, 7), generator=g, dtype=dtype)
        t[0, 0], t[0, 1] = info.min, info.max
    tensors = {"a": t, "scalar": t[1, 1].clone(), "empty": t[:0].clone(), "transposed": t.t()}
    path = tmp_path / "x.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    out = map_tensors(path)
    assert out.keys() == tensors.keys()
    for k, v in tensors.items():
        assert out[k].dtype == dtype and out[k].shape == v.shape, k
        if dtype.is_floating_point:  # bitwise: -0.0 and inf included
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
            assert torch.equal(out[k].contiguous().view(bits), v.contiguous().view(bits)), k
        assert torch.equal(out[k], v), k


def test_store_round_trips_mixed_dtypes_through_weight_version(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(7, generator=g).to(torch.float16),
        "fp32": torch.randn(2, 3, 4, generator=g),
        "i64": torch.arange(-5, 6, dtype=torch.int64) * (1 << 40),
        "noncontig": torch.randn(6, 4, generator=g).t(),
    }
    store = WeightStore(str(tmp_path), RUN, shard_bytes=200)
    pub = publish(store, 0, tensors)
    with WeightVersion(pub.path, verify=True) as wv:
        assert wv.tensors.keys() == tensors.keys()
        for k, t in tensors.items():
            assert wv.tensors[k].dtype == t.dtype and torch.equal(wv.tensors[k], t), k


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_map_tensors_rejects_inconsistent_offsets_and_unknown_dtypes(tmp_path):
    ok = tmp_path / "ok.safetensors"
    _write_raw_safetensors(ok, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    assert torch.equal(map_tensors(ok)["a"], torch.zeros(2))

    short = tmp_path / "short.safetensors"
    _write_raw_safetensors(short, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="inconsistent offsets"):
        map_tensors(short)

    wrong = tmp_path / "wrong.safetensors"
    _write_raw_safetensors(wrong, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="inconsistent offsets"):
        map_tensors(wrong)

    odd = tmp_path / "odd.safetensors"
    _write_raw_safetensors(odd, {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="unsupported dtype"):
        map_tensors(odd)


# ---------------------------------------------------------------- verification


def test_verify_passes_for_a_good_version_and_catches_a_flipped_byte(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1, shard_bytes=600)
    pub = publish(store, 0)
    with WeightVersion(pub.path, verify=True) as wv:
        wv.verify()
    shard = sorted(Path(pub.path).glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of tensor data: same size, different hash
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    WeightVersion(pub.path).close()  # without verify it opens
    with pytest.raises(ChecksumError, match="sha256"):
        WeightVersion(pub.path, verify=True)
    assert issubclass(ChecksumError, ValueError)
    # a refused version is not held: the collector can remove it
    publish(store, 1)
    assert list_versions(tmp_path, RUN) == [1]


def test_verify_catches_truncated_and_missing_files(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=5, checksum="none")
    a, b = publish(store, 0), publish(store, 1)
    shard = Path(a.path) / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ChecksumError, match="bytes"):
        WeightVersion(a.path, verify=True)
    (Path(b.path) / "config.json").unlink()
    with pytest.raises(ChecksumError):
        WeightVersion(b.path, verify=True)


def test_verify_catches_an_edited_config(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    pub = store.publish(0, iter(small_tensors().items()), {"model_type": "llama", "hidden_size": 8})
    cfg = Path(pub.path) / "config.json"
    cfg.write_text(cfg.read_text().replace("llama", "LLAMA"))  # same size
    with pytest.raises(ChecksumError, match="config.json"):
        WeightVersion(pub.path, verify=True)


# ---------------------------------------------------------------- HF loads a published version


def test_transformers_loads_a_published_tiny_llama_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(QUICKSTART, [])
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(str(tmp_path), RUN, shard_bytes=100_000)  # sharded, with an index
    pub = store.publish(0, hf_state(model), hf_config(model))
    assert len(list(Path(pub.path).glob("*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(pub.path).eval()
    assert type(loaded) is type(model)
    assert set(loaded.state_dict()) == set(model.state_dict())
    tokens = torch.tensor([[11, 1, 2, 3, 4, 12, 1, 2], [11, 9, 8, 7, 6, 12, 9, 13]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_transformers_loads_a_tied_model_published_without_the_duplicate(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(QUICKSTART, ["model.arch.tie_word_embeddings=true"])
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(str(tmp_path), RUN)
    pub = store.publish(0, hf_state(model), hf_config(model))
    with WeightVersion(pub.path) as wv:
        assert "lm_head.weight" not in wv.tensors and "model.embed_tokens.weight" in wv.tensors
    loaded = AutoModelForCausalLM.from_pretrained(pub.path).eval()
    tokens = torch.tensor([[11, 3, 1, 4, 1, 12, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)


# ---------------------------------------------------------------- shared memory


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_store_in_dev_shm(shm_root):
    root = shm_root if shm_root.startswith("/dev/shm") else pytest.skip("no /dev/shm")
    run = f"unit-{uuid.uuid4().hex[:8]}"
    store = WeightStore(root, run, keep=2)
    for v in range(3):
        publish(store, v)
    run_dir = Path(root) / run
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert list_versions(root, run) == [1, 2]
    with WeightVersion(version_dir(root, run, 2), verify=True) as wv:
        assert torch.equal(wv.tensors["model.norm.weight"], small_tensors(2)["model.norm.weight"])
    assert hidden_entries(run_dir) == []


# ---------------------------------------------------------------- subscribe (store scan)


def _collect(gen, out: list, got: queue.Queue | None = None):
    for wv in gen:
        out.append(wv.version)
        if got is not None:
            got.put(wv.version)


def test_subscribe_late_joiner_gets_newest_then_each_new_version_in_order(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    for v in range(3):
        publish(store, v)
    seen: list[int] = []
    got: queue.Queue = queue.Queue()
    t = threading.Thread(target=_collect, args=(subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=2.0), seen, got))
    t.start()
    try:
        assert got.get(timeout=10) == 2  # the newest existing one first, not 0
        for v in range(3, 6):
            publish(store, v)
            assert got.get(timeout=10) == v
    finally:
        t.join(timeout=30)
    assert not t.is_alive()
    assert seen == [2, 3, 4, 5]


def test_subscribe_latest_only_jumps_to_the_newest(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=1.0)
    first = next(gen)
    assert first.version == 0
    for v in (1, 2, 3):  # published while the subscriber is busy
        publish(store, v)
    assert next(gen).version == 3
    assert list(gen) == []  # then nothing new: ends after timeout_s


def test_subscribe_all_versions_in_order(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    for v in range(4):
        publish(store, v)
    got = [wv.version for wv in subscribe(str(tmp_path), RUN, latest_only=False, poll_s=0.02, timeout_s=0.5)]
    assert got == [0, 1, 2, 3]
    got = [wv.version for wv in subscribe(str(tmp_path), RUN, latest_only=False, start=2, poll_s=0.02,
                                          timeout_s=0.5)]
    assert got == [2, 3]

    gen = subscribe(str(tmp_path), RUN, latest_only=False, start=4, poll_s=0.02, timeout_s=1.0)
    seen: list[int] = []
    t = threading.Thread(target=_collect, args=(gen, seen))
    t.start()
    time.sleep(0.1)
    for v in (4, 5, 6):
        publish(store, v)
    t.join(timeout=30)
    assert not t.is_alive()
    assert seen == [4, 5, 6]


def test_subscribe_all_versions_yields_every_version_published_in_a_burst(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, latest_only=False, poll_s=0.02, timeout_s=1.0)
    assert next(gen).version == 0
    for v in (1, 2, 3):
        publish(store, v)
    assert [wv.version for wv in gen] == [1, 2, 3]


def test_subscribe_ends_after_timeout(tmp_path):
    WeightStore(str(tmp_path), RUN)
    t0 = time.monotonic()
    assert list(subscribe(str(tmp_path), RUN, poll_s=0.05, timeout_s=0.3)) == []
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 3


def test_subscribe_ends_when_stop_is_set(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    publish(store, 0)
    stop = threading.Event()
    gen = subscribe(str(tmp_path), RUN, poll_s=0.05, stop=stop)  # no timeout
    assert next(gen).version == 0
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert list(gen) == []
    assert time.monotonic() - t0 < 5


def test_subscribe_releases_the_previous_version_unless_hold(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=2.0)
    v0 = next(gen)
    v0_tensors = v0.tensors  # mapped while held
    publish(store, 1)
    assert list_versions(tmp_path, RUN) == [0, 1]  # held by the subscriber
    assert next(gen).version == 1  # yielding v1 releases v0
    publish(store, 2)
    assert list_versions(tmp_path, RUN) == [1, 2]
    assert torch.equal(v0_tensors["lm_head.weight"], small_tensors(0)["lm_head.weight"])  # views still valid
    gen.close()  # leaving the loop releases the current one
    assert store.collect() == [1]

    held = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=2.0, hold=True)
    a = next(held)
    assert a.version == 2
    publish(store, 3)
    b = next(held)
    assert b.version == 3
    publish(store, 4)
    assert list_versions(tmp_path, RUN) == [2, 3, 4]  # the caller holds both
    held.close()
    a.close()
    b.close()
    assert store.collect() == [2, 3]


def test_subscribe_verify_yields_verified_versions(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=0.3, verify=True)
    wv = next(gen)
    assert wv.version == 0 and torch.equal(wv.tensors["model.norm.weight"], small_tensors(0)["model.norm.weight"])
    gen.close()


# ---------------------------------------------------------------- subscribe with a real PUB socket


def _announce(pub: zmq.Socket, store_root: Path, version: int) -> None:
    msg = protocol.WeightAnnouncement(version=version, path=str(version_dir(store_root, RUN, version)),
                                      total_bytes=0, publish_seconds=0.0, step=version)
    pub.send_multipart(protocol.encode(msg))


def test_subscribe_follows_announcements_and_ends_on_goodbye(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    publish(store, 0)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    # poll_s is long: only an announcement can wake the subscriber quickly
    gen = subscribe(str(tmp_path), RUN, announce=f"tcp://127.0.0.1:{port}", poll_s=5.0, timeout_s=60.0)
    seen: list[int] = []
    got: queue.Queue = queue.Queue()
    t = threading.Thread(target=_collect, args=(gen, seen, got), daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        first = None
        while first is None and time.monotonic() - t0 < 20:  # the SUB side connects asynchronously
            pub.send_multipart([b"not a protocol message"])  # ignored, never fatal
            _announce(pub, tmp_path, 0)
            try:
                first = got.get(timeout=0.05)
            except queue.Empty:
                pass
        assert first == 0

        publish(store, 1)
        t1 = time.monotonic()
        _announce(pub, tmp_path, 1)
        assert got.get(timeout=10) == 1
        assert time.monotonic() - t1 < 3  # woken by the announcement, not by the 5 s store scan

        t2 = time.monotonic()
        while t.is_alive() and time.monotonic() - t2 < 20:
            pub.send_multipart(protocol.encode(protocol.Goodbye(reason="done")))
            t.join(timeout=0.05)
        assert not t.is_alive()
        assert time.monotonic() - t2 < 3  # ended by Goodbye, long before timeout_s
    finally:
        pub.close(0)
        ctx.term()
    assert seen == [0, 1]


def test_subscribe_with_verify_skips_a_corrupt_version_and_keeps_going(tmp_path):
    store = WeightStore(str(tmp_path), "run", keep=10)
    for v in range(3):
        publish(store, v)
    shard = next((tmp_path / "run" / "v2").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    publish(store, 3)
    seen = [wv.version for wv in subscribe(str(tmp_path), "run", latest_only=False, verify=True, poll_s=0.05,
                                           timeout_s=0.5)]
    assert seen == [0, 1, 3]


def test_a_recycled_shard_gets_back_the_file_that_last_held_its_name(tmp_path):
    """The sharded publish's ranks create their files in any order: each takes the pooled file its shard's name held
    (whose map the rank that wrote it keeps registered), not the oldest of that size (another rank's)."""
    store = WeightStore(str(tmp_path), RUN, keep=1, shard_bytes=1 << 20, reuse_files=True)
    big = {f"model.layers.{i}.weight": torch.randn(200_000) for i in range(3)}  # 3 shards of one size
    inodes = {}
    for v in range(2):
        pub = publish(store, v, {k: t + v for k, t in big.items()})
        inodes[v] = {f.name: f.stat().st_ino for f in Path(pub.path).glob("*.safetensors")}
    pooled = sorted(os.listdir(store.free))
    assert [p.partition("-")[2] for p in pooled] == sorted(inodes[0])  # counter, then the name each held
    names = sorted(inodes[0], reverse=True)  # the last shard's writer first
    target = tmp_path / "staging"
    target.mkdir()
    size = (store.free / pooled[0]).stat().st_size
    for name in names:
        assert store.take_free(size, target / name)
        assert (target / name).stat().st_ino == inodes[0][name]
    assert not store.take_free(size, target / "other")  # the pool is empty
    (store.free / "000000000007").write_bytes(b"x" * size)  # a pool of older code: bare counters, still taken
    assert WeightStore(str(tmp_path), RUN, keep=1, reuse_files=True, sweep=False)._seq == 7  # counted on from it
    assert store.take_free(size, target / "other")
