"""Tests for offpolicy/weights/store.py: the versioned store's layout, modes and sharding, atomic publishes and the
sweep of leftovers, garbage collection under readers in this and other processes, a store in /dev/shm, and the
pool of collected files that new versions reuse."""

from __future__ import annotations

import gc
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from offpolicy.weights import (
    Manifest,
    WeightStore,
    WeightVersion,
    list_versions,
    version_dir,
)
from offpolicy.weights.safetensors_view import read_header
from offpolicy.weights.store import INDEX, MANIFEST
from tests.weight_stores import RUN, hidden_entries, publish, sha256, small_tensors


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
