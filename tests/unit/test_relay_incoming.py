"""Tests for offpolicy.relay.incoming: manifests from upstream are checked before anything is written,
chunks land where they belong in any order, served ranges are exactly the received bytes, the
in-order sha256 catches a damaged byte, and a version enters the store only through
`WeightStore.stage` (hidden directory, rename, 0700/0600), byte for byte like the source."""

from __future__ import annotations

import asyncio
import os
import random
import stat
import zlib
from pathlib import Path

import msgspec
import pytest
import torch

from offpolicy.relay.incoming import ChunkMismatch, Incoming, parse_manifest
from offpolicy.weights import WeightStore, WeightVersion, list_versions, version_dir
from offpolicy.weights.store import MANIFEST, FileEntry, Manifest
from offpolicy.wire.protocol import ProtocolError

RUN = "inc"
CHUNK = 64 * 1024


@pytest.fixture
def source(shm_root):
    """A published version of about 1.2 MB in three shards, and its raw manifest."""
    store = WeightStore(f"{shm_root}/learner", RUN, shard_bytes=1 << 20)
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randn(50_000 + 1000 * i, generator=g) for i in range(6)}
    store.publish(3, iter(tensors.items()), {"model_type": "llama"})
    path = version_dir(store.root, RUN, 3)
    return path, (path / MANIFEST).read_bytes()


def chunks_of(path: Path, inc: Incoming) -> list[tuple[str, int, bytes]]:
    return [(name, off, (path / name).read_bytes()[off: off + n]) for name, off, n in inc.chunks()]


def receive(source, relay_root: str, order=None, damage: tuple[str, int] | None = None) -> tuple[list[str], Path]:
    path, raw = source
    manifest = parse_manifest(raw, 3)
    store = WeightStore(relay_root, RUN)
    with store.stage(3) as tmp:
        inc = Incoming(tmp, 3, raw, manifest, CHUNK)
        pieces = chunks_of(path, inc)
        for name, off, data in (order(pieces) if order else pieces):
            if damage and (name, off) == damage:
                data = bytes([data[0] ^ 1]) + data[1:]
            inc.write(name, off, data)
        assert inc.complete
        bad = asyncio.run(inc.mismatches())
        inc.close()
        if bad:
            raise _Refused(bad)  # the stage removes the hidden directory
        inc.finish()
    return bad, tmp


class _Refused(Exception):
    def __init__(self, bad):
        self.bad = bad


@pytest.mark.parametrize("order", [None, lambda p: list(reversed(p)), lambda p: random.Random(1).sample(p, len(p))],
                         ids=["in-order", "reversed", "shuffled"])
def test_received_version_is_byte_identical_and_loads(source, shm_root, order):
    bad, _ = receive(source, f"{shm_root}/relay", order)
    assert bad == []
    src, got = source[0], version_dir(f"{shm_root}/relay", RUN, 3)
    assert sorted(os.listdir(got)) == sorted(os.listdir(src))
    for name in os.listdir(src):
        assert (got / name).read_bytes() == (src / name).read_bytes(), name
        assert stat.S_IMODE((got / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(got.stat().st_mode) == 0o700
    with WeightVersion(got, verify=True) as wv:
        assert set(wv.tensors) == {f"layer.{i}.weight" for i in range(6)}


def test_a_damaged_chunk_is_named_and_nothing_enters_the_store(source, shm_root):
    first_shard = sorted(n for n in parse_manifest(source[1], 3).files if n.endswith(".safetensors"))[0]
    with pytest.raises(_Refused) as refused:
        receive(source, f"{shm_root}/relay", damage=(first_shard, 2 * CHUNK))
    assert refused.value.bad == [first_shard]
    run = Path(shm_root) / "relay" / RUN
    assert list_versions(f"{shm_root}/relay", RUN) == []
    assert [e.name for e in os.scandir(run)] == []  # the hidden staging directory is gone too


@pytest.fixture
def unhashed(shm_root):
    """A version published with weights.checksum none (no sha256 in the manifest), and its raw manifest."""
    store = WeightStore(f"{shm_root}/learner", RUN, shard_bytes=1 << 20, checksum="none")
    g = torch.Generator().manual_seed(1)
    store.publish(3, iter({f"layer.{i}.weight": torch.randn(60_000, generator=g) for i in range(4)}.items()),
                  {"model_type": "llama"})
    path = version_dir(store.root, RUN, 3)
    return path, (path / MANIFEST).read_bytes()


def test_without_sha256_every_chunk_is_checked_against_the_sources_crc32_and_passed_on(unhashed, shm_root):
    path, raw = unhashed
    store = WeightStore(f"{shm_root}/relay", RUN)
    with store.stage(3) as tmp:
        inc = Incoming(tmp, 3, raw, parse_manifest(raw, 3), CHUNK)
        for name, off, data in reversed(chunks_of(path, inc)):
            inc.write(name, off, data, zlib.crc32(data))
        name = max(inc.manifest.files, key=lambda n: inc.manifest.files[n].bytes)
        data = (path / name).read_bytes()
        assert inc.crc32(name, CHUNK, CHUNK) == zlib.crc32(data[CHUNK: 2 * CHUNK])  # the verified one, kept
        assert inc.crc32(name, 10, 100) == zlib.crc32(data[10: 110])  # off this node's grid: computed here
        assert inc.complete and asyncio.run(inc.mismatches()) == []
        inc.close()
        inc.finish()
    for name in os.listdir(path):
        assert (version_dir(f"{shm_root}/relay", RUN, 3) / name).read_bytes() == (path / name).read_bytes()


@pytest.mark.parametrize("bad", ["damaged", "missing"])
def test_a_chunk_that_fails_or_lacks_its_crc32_is_refused_before_it_is_written_or_served(unhashed, shm_root, bad):
    path, raw = unhashed
    store = WeightStore(f"{shm_root}/relay", RUN)
    with pytest.raises(ChunkMismatch) as refused, store.stage(3) as tmp:
        inc = Incoming(tmp, 3, raw, parse_manifest(raw, 3), CHUNK)
        name, off, data = chunks_of(path, inc)[2]
        crc = zlib.crc32(data)
        try:
            inc.write(name, off, bytes([data[0] ^ 1]) + data[1:] if bad == "damaged" else data,
                      crc if bad == "damaged" else None)
        finally:
            assert not inc.have(name, off, len(data)) and inc.received == 0
            with open(tmp / name, "rb") as f:
                assert os.pread(f.fileno(), len(data), off) == bytes(len(data))  # not written
            inc.close()
    assert f"{name} bytes {off}+{len(data)}" in str(refused.value)
    assert ("the source's missing" in str(refused.value)) == (bad == "missing")
    assert list_versions(f"{shm_root}/relay", RUN) == [] and os.listdir(Path(shm_root) / "relay" / RUN) == []


def test_have_and_view_cover_exactly_the_received_ranges(source, shm_root):
    path, raw = source
    store = WeightStore(f"{shm_root}/relay", RUN)
    with pytest.raises(RuntimeError), store.stage(3) as tmp:
        inc = Incoming(tmp, 3, raw, parse_manifest(raw, 3), CHUNK)
        name = next(n for n in inc.manifest.files if n.endswith(".safetensors"))
        data = (path / name).read_bytes()
        inc.write(name, CHUNK, data[CHUNK: 2 * CHUNK])
        assert inc.have(name, CHUNK, CHUNK) and inc.have(name, CHUNK + 10, 100)
        assert not inc.have(name, 0, CHUNK) and not inc.have(name, CHUNK, CHUNK + 1)
        assert inc.have(name, 0, 0)
        assert inc.view(name, CHUNK + 5, 1000).tobytes() == data[CHUNK + 5: CHUNK + 1005]
        assert not inc.complete
        inc.close()
        raise RuntimeError("abandon")
    assert list_versions(f"{shm_root}/relay", RUN) == []


def test_chunks_cover_every_file_and_empty_files_need_none(shm_root):
    files = {"a.safetensors": FileEntry(bytes=3 * CHUNK + 7), "empty.json": FileEntry(bytes=0),
             "config.json": FileEntry(bytes=CHUNK)}
    raw = msgspec.json.encode(Manifest(version=1, created_unix=0.0, total_bytes=0, num_tensors=0, files=files))
    store = WeightStore(shm_root, RUN)
    with store.stage(1) as tmp:
        inc = Incoming(tmp, 1, raw, parse_manifest(raw, 1), CHUNK)
        got = inc.chunks()
        assert got == [("a.safetensors", 0, CHUNK), ("a.safetensors", CHUNK, CHUNK),
                       ("a.safetensors", 2 * CHUNK, CHUNK), ("a.safetensors", 3 * CHUNK, 7), ("config.json", 0, CHUNK)]
        assert os.path.getsize(tmp / "a.safetensors") == 3 * CHUNK + 7 and os.path.getsize(tmp / "empty.json") == 0
        for name, off, n in got:
            inc.write(name, off, b"x" * n, zlib.crc32(b"x" * n))
        assert inc.complete and asyncio.run(inc.mismatches()) == []  # no sha256 in this manifest: sizes only
        inc.close()
        inc.finish()
    assert list_versions(shm_root, RUN) == [1]


def manifest_with(name: str, version: int = 1, size: int = 10) -> bytes:
    return msgspec.json.encode(Manifest(version=version, created_unix=0.0, total_bytes=size, num_tensors=1,
                                        files={name: FileEntry(bytes=size)}))


@pytest.mark.parametrize("name", ["../evil", "a/b", "/etc/passwd", ".hidden", "manifest.json", "", "..", "a\\b"])
def test_unsafe_file_names_are_refused(name):
    with pytest.raises(ProtocolError, match="unsafe file"):
        parse_manifest(manifest_with(name), 1)


@pytest.mark.parametrize("raw, match", [
    (b"not json", "does not decode"),
    (b'{"version": 1}', "does not decode"),
    (manifest_with("a.safetensors", version=2), "says version 2"),
    (manifest_with("a.safetensors", size=-1), "negative size"),
])
def test_bad_manifests_are_refused(raw, match):
    with pytest.raises(ProtocolError, match=match):
        parse_manifest(raw, 1)
