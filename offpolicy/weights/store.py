"""The versioned weight store: one directory per version in shared host memory.

Layout: `<root>/<run>/v<N>/` holds HF-layout safetensors shards (`model-0000i-of-0000n.safetensors`),
`model.safetensors.index.json`, `config.json` and `manifest.json` (sizes and checksums). Invariants:
- A version is written into a hidden sibling directory and renamed into place, so a reader never
  sees a half-written version; `manifest.json` is the last file written.
- Directories are mode 0700, files 0600 (only the run's user reads weights).
- The newest `keep` versions stay. An older version is removed only when no reader holds it: readers
  take a shared `flock` on its manifest (released by the kernel when a reader dies); the collector
  takes an exclusive non-blocking lock and skips versions it cannot lock.
- `stage(version)` is the one way a version enters the store (the learner's `publish` and the
  cross-node relay both go through it). This module imports torch only to write tensors, so
  readers of the store (the relay) stay light.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")


class FileEntry(msgspec.Struct):
    bytes: int
    sha256: str = ""  # empty when the store runs with checksum "none"


class Manifest(msgspec.Struct):
    version: int
    created_unix: float
    total_bytes: int  # tensor bytes over all shards
    num_tensors: int
    files: dict[str, FileEntry]  # every file of the version but the manifest itself
    checksum: str = "sha256"


class Published(msgspec.Struct):
    version: int
    path: str
    total_bytes: int
    seconds: float


def run_dir(root: str | os.PathLike, run: str) -> Path:
    return Path(root) / run


def version_dir(root: str | os.PathLike, run: str, version: int) -> Path:
    return run_dir(root, run) / f"v{version}"


def list_versions(root: str | os.PathLike, run: str) -> list[int]:
    """Complete versions in the store, oldest first."""
    d = run_dir(root, run)
    if not d.is_dir():
        return []
    out = []
    for entry in os.scandir(d):
        m = _VERSION_DIR.match(entry.name)
        if m and os.path.exists(os.path.join(entry.path, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


def read_manifest(path: str | os.PathLike) -> Manifest:
    with open(Path(path) / MANIFEST, "rb") as f:
        return msgspec.json.decode(f.read(), type=Manifest)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


class WeightStore:
    """Writer side of the store (the learner's weight broadcaster publishes through it)."""

    def __init__(self, root: str, run: str, keep: int = 3, shard_bytes: int = 2 << 30,
                 checksum: str = "sha256"):
        self.root, self.run, self.keep = root, run, keep
        self.shard_bytes, self.checksum = shard_bytes, checksum
        self.dir = run_dir(root, run)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self._sweep_partial()

    def _sweep_partial(self) -> None:
        """Remove hidden half-written versions left by a writer that died."""
        for entry in os.scandir(self.dir):
            if entry.name.startswith(".v") and entry.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict) -> Published:
        """Write `version` atomically from (HF name, tensor) pairs and collect old versions."""
        t0 = time.perf_counter()
        with self.stage(version) as tmp:
            shards = self._write_shards(tmp, tensors)
            files = self._write_meta(tmp, shards, hf_config)
            total = sum(n for _, n, _ in shards)
            manifest = Manifest(version=version, created_unix=time.time(), total_bytes=total,
                                num_tensors=sum(len(names) for _, _, names in shards), files=files,
                                checksum=self.checksum)
            write_private(tmp / MANIFEST, msgspec.json.encode(manifest))
        self.collect()
        return Published(version=version, path=str(version_dir(self.root, self.run, version)),
                         total_bytes=total, seconds=time.perf_counter() - t0)

    @contextmanager
    def stage(self, version: int) -> Iterator[Path]:
        """A hidden sibling directory to write `version` into; renamed into place when the block ends.

        The caller writes every file, `manifest.json` last. If the block raises, the directory is
        removed and nothing appears in the store. Collecting old versions is the caller's next step.
        """
        final = version_dir(self.root, self.run, version)
        if final.exists():
            raise FileExistsError(f"weight version {version} already exists at {final}")
        tmp = self.dir / f".v{version}.tmp-{os.getpid()}"
        tmp.mkdir(mode=0o700)
        try:
            yield tmp
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_shards(self, tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]]):
        from safetensors.torch import save_file

        groups: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors:
            t = t.detach().to("cpu").contiguous()
            n = t.numel() * t.element_size()
            if groups[-1] and size + n > self.shard_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = t
            size += n
        count = len(groups)
        shards = []
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            save_file(group, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o600)
            shards.append((fname, sum(t.numel() * t.element_size() for t in group.values()), list(group)))
        return shards

    def _write_meta(self, tmp: Path, shards, hf_config: dict) -> dict[str, FileEntry]:
        total = sum(n for _, n, _ in shards)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: fname for fname, _, names in shards for name in names}}
        write_private(tmp / INDEX, json.dumps(index, indent=2).encode())
        write_private(tmp / "config.json", json.dumps(hf_config, indent=2).encode())
        names = [f for f, _, _ in shards] + [INDEX, "config.json"]
        with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:  # hashlib drops the GIL
            sums = list(pool.map(self._checksum, [tmp / n for n in names]))
        return {n: FileEntry(bytes=os.path.getsize(tmp / n), sha256=s) for n, s in zip(names, sums)}

    def _checksum(self, path: Path) -> str:
        return sha256_file(path) if self.checksum == "sha256" else ""

    def drop_after(self, version: int) -> list[int]:
        """Remove versions newer than `version` (a resumed learner's abandoned future); returns them."""
        doomed = [v for v in list_versions(self.root, self.run) if v > version]
        for v in doomed:
            tmp = self.dir / f".v{v}.gc-{os.getpid()}"
            os.rename(version_dir(self.root, self.run, v), tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        return doomed

    def collect(self) -> list[int]:
        """Remove versions older than the newest `keep` that no reader holds; returns those removed."""
        versions = list_versions(self.root, self.run)
        removed = []
        for v in versions[: max(0, len(versions) - self.keep)]:
            path = version_dir(self.root, self.run, v)
            try:
                fd = os.open(path / MANIFEST, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a reader holds it; try again after the next publish
            try:
                doomed = self.dir / f".v{v}.gc-{os.getpid()}"
                os.rename(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(v)
            finally:
                os.close(fd)
        return removed


def write_private(path: Path, data: bytes) -> None:
    """Create `path` (mode 0600, failing if it exists) holding `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
