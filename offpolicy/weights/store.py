"""The versioned weight store: one directory per version in shared host memory.

Layout: `<root>/<run>/v<N>/` holds HF-layout safetensors shards (`model-0000i-of-0000n.safetensors`),
`model.safetensors.index.json`, `config.json` and `manifest.json` (sizes and checksums). Invariants:
- A version is written into a hidden sibling directory and renamed into place, so a reader never
  sees a half-written version; `manifest.json` is the last file written.
- Directories are mode 0700, files 0600 (only the run's user reads weights).
- The newest `keep` versions stay. An older version is removed only when no reader holds it: readers
  take a shared `flock` on its manifest (released by the kernel when a reader dies); the collector
  takes an exclusive non-blocking lock and skips versions it cannot lock.
- With `reuse_files` (weights.reuse_files), the shard files of collected versions go to a hidden pool
  (`.free/`) and new versions are written into them: their pages stay allocated, so a publish copies
  into memory instead of allocating (and zeroing or faulting in) every page. The cost: a reader that
  closed a version must not keep its tensors (their map would see the next version's bytes).
  A recycled file is never resized: a shard takes a pooled file of exactly its size (a model's
  versions have the same shards, so there is one) or a fresh file; first the one that last held the
  shard's own name (its inode then comes back to the rank that wrote that shard before, whose map of
  it is registered: a learner whose ranks write shards of one size took each other's files, and each
  met one file a version it had never mapped, on the staged path: TP2's publish far slower than EP2's,
  docs/benchmarks.md). Processes that keep a file's map
  page-locked (`register_maps`, weights/maps.py) rely on that: truncating a file would leave their
  pinned pages orphaned.
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
import struct
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from offpolicy.plumbing.trace import now
from offpolicy.weights.config_json import complete
from offpolicy.weights.profile import stage as timed

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")
PARALLEL_SHARD_BYTES = 128 << 20  # smallest shard the store cuts to write a version in parallel
FREE = ".free"  # hidden folder of shard files kept for reuse (WeightStore reuse_files)
FREE_FILES = 64  # shard files the free pool keeps at most


class FileEntry(msgspec.Struct):
    bytes: int
    sha256: str = ""  # empty when the store runs with checksum "none"
    node: int = 0  # the learner node whose store holds it (a version written from several nodes; weights/sharded.py)


class Manifest(msgspec.Struct):
    version: int
    created_unix: float
    total_bytes: int  # tensor bytes over all shards
    num_tensors: int
    files: dict[str, FileEntry]  # every file of the version but the manifest itself
    checksum: str = "sha256"
    format: str = "native"  # weight format of the tensors: native (model.dtype), fp8, mxfp4 (weights/formats.py)
    nodes: int = 1  # learner nodes whose stores hold parts of it (each file's `node`); 1 = all in one store


class Published(msgspec.Struct):
    version: int
    path: str
    total_bytes: int
    seconds: float
    committed: float = 0.0  # time (plumbing.trace.now()) just before the version was renamed into place: no reader
    # can have seen it earlier (the run's timeline ends its publish span there); 0 = not written by this call
    phases: list[tuple[str, float, float]] = []  # a sharded publish's parts on rank 0: (name, wall start, seconds)
    fresh_files: int = 0  # a sharded publish: files rank 0 created new, none of that size free in the pool
    staged_files: int = 0  # a sharded publish: files rank 0 wrote through pinned buffers, not a registered map


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
    """Writer side of the store (the learner's weight publisher publishes through it)."""

    def __init__(self, root: str, run: str, keep: int = 3, shard_bytes: int = 2 << 30,
                 checksum: str = "sha256", reuse_files: bool = False, register_maps: bool = False,
                 fmt: str = "native", sweep: bool = True, gap_bytes: int = 0):
        self.root, self.run, self.keep, self.fmt = root, run, keep, fmt  # fmt: recorded in each manifest
        self.shard_bytes, self.checksum, self.reuse_files = shard_bytes, checksum, reuse_files
        self.gap_bytes = gap_bytes  # weights.publish_gap_mib: the copies into maps pause the copy engine this often
        self.dir = run_dir(root, run)
        self.committed = 0.0  # wall time just before the newest version staged here was renamed into place
        self.free = self.dir / FREE  # shard files of collected versions, for reuse_files
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        if sweep:  # False: another process of this node may be writing into the store right now
            self._sweep_partial()
        self._seq = max((_pooled(f.name)[0] for f in self.free.iterdir()), default=0) \
            if self.free.is_dir() else 0  # pool files are named by a counter (the oldest sorts first), then the
        # name the file held ("000000000012-model-00001-of-00003.safetensors")
        # weights.register_maps: GPU tensors go straight into page-locked maps of recycled files (only
        # files come back with reuse_files); one cache per process, bounded to keep + 2 versions
        self.maps = None
        if register_maps and reuse_files:
            from offpolicy.weights.maps import shared

            self.maps = shared(keep + 2)

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
            with timed("publish.meta"):
                files = self._write_meta(tmp, shards, hf_config)
                total = sum(n for _, n, _, _ in shards)
                manifest = Manifest(version=version, created_unix=time.time(), total_bytes=total,
                                    num_tensors=sum(len(names) for _, _, names, _ in shards), files=files,
                                    checksum=self.checksum, format=self.fmt)
                write_private(tmp / MANIFEST, msgspec.json.encode(manifest))
        with timed("publish.collect"):
            self.collect()
        return Published(version=version, path=str(version_dir(self.root, self.run, version)),
                         total_bytes=total, seconds=time.perf_counter() - t0, committed=self.committed)

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
            with timed("publish.rename"):
                self.committed = now()
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_shards(self, tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]]):
        """Write the tensors as safetensors shards of at most `shard_bytes` (a single larger tensor gets
        a shard of its own). Each file is created at its final size with its header, then one thread
        per file `pwrite`s the tensor bytes straight from the tensors' memory (GPU tensors through
        pinned buffers; `transfer.write_files`) and hashes each chunk it wrote: no serialised copy of
        the whole shard as `safetensors.save_file` makes, no second read for the checksum.

        Writes into one file are serialised by the kernel (and fresh shared memory is slow to
        write per stream), so a large version is cut into at least as many shards as there are
        writer threads, none smaller than PARALLEL_SHARD_BYTES: 16 threads write fresh /dev/shm
        many times faster into 16 files than into one (`offpolicy bench weights`; docs/benchmarks.md,
        "Weights").
        With `register_maps`, a recycled file that this process has written before is written by the
        GPU straight into its page-locked map instead (weights/maps.py)."""
        from offpolicy.weights.transfer import THREADS, flat_bytes, write_files

        with timed("publish.group"):
            named = [(name, t.detach().contiguous()) for name, t in tensors]
            total = sum(t.numel() * t.element_size() for _, t in named)
            limit = min(self.shard_bytes, max(PARALLEL_SHARD_BYTES, -(-total // THREADS)))
            groups: list[list[tuple[str, torch.Tensor]]] = [[]]
            size = 0
            for name, t in named:
                n = t.numel() * t.element_size()
                if groups[-1] and size + n > limit:
                    groups.append([])
                    size = 0
                groups[-1].append((name, t))
                size += n
        count = len(groups)
        shards, files = [], []
        try:
            with timed("publish.files"):
                pool = self._free_files()
                for i, group in enumerate(groups):
                    fname = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                    header, offsets = _shard_header(group)
                    size = len(header) + (offsets[-1][1] if offsets else 0)
                    if pool.get(size):  # a recycled file of exactly this size (it is never resized)
                        os.rename(pool[size].pop(0), tmp / fname)
                    fd = create_shard(tmp / fname, header, size)
                    base = len(header)
                    pieces = [(flat_bytes(t), base + b) for (_, t), (b, e) in zip(group, offsets) if e > b]
                    files.append((fd, size, pieces, self.checksum == "sha256"))
                    shards.append((fname, offsets[-1][1] if offsets else 0, [name for name, _ in group]))
            with timed("publish.write"):
                sums = write_files(files, maps=self.maps, gap=self.gap_bytes)
        finally:
            for fd, *_ in files:
                os.close(fd)
        return [(fname, n, names, digest) for (fname, n, names), digest in zip(shards, sums)]

    def _write_meta(self, tmp: Path, shards, hf_config: dict) -> dict[str, FileEntry]:
        """Write the index and config.json; every file's entry (the shards' sha256 came from the writers)."""
        total = sum(n for _, n, _, _ in shards)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: fname for fname, _, names, _ in shards for name in names}}
        write_private(tmp / INDEX, json.dumps(index, indent=2).encode())
        write_private(tmp / "config.json", json.dumps(complete(hf_config), indent=2).encode())
        sums = {fname: digest for fname, _, _, digest in shards}
        sums.update({n: self._checksum(tmp / n) for n in (INDEX, "config.json")})
        return {n: FileEntry(bytes=os.path.getsize(tmp / n), sha256=s) for n, s in sums.items()}

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
                if self.reuse_files:
                    self._keep_files(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(v)
            finally:
                os.close(fd)
        return removed


    def _keep_files(self, doomed: Path) -> None:
        """Move a collected version's shards into the free pool, named by a counter and the name each held;
        beyond FREE_FILES the oldest are deleted (a pool that only grew could fill with files of sizes nobody
        needs)."""
        self.free.mkdir(mode=0o700, exist_ok=True)
        for f in sorted(doomed.glob("*.safetensors")):
            self._seq += 1
            os.rename(f, self.free / f"{self._seq:012d}-{f.name}")
        pool = sorted(self.free.iterdir())
        for f in pool[: max(0, len(pool) - FREE_FILES)]:
            f.unlink(missing_ok=True)

    def take_free(self, size: int, path: Path) -> bool:
        """With reuse_files, move a pooled file of exactly `size` bytes to `path` (True), else False: the oldest
        that last held `path`'s name, else the oldest of that size. Safe among processes: a file another one took
        first is skipped."""
        pooled = self._free_files().get(size, [])
        for f in sorted(pooled, key=lambda f: _pooled(f.name)[1] != path.name):  # stable: oldest first
            try:
                os.rename(f, path)
                return True
            except FileNotFoundError:
                continue
        return False

    def _free_files(self) -> dict[int, list[Path]]:
        """With reuse_files, the pool's files by size, oldest first."""
        out: dict[int, list[Path]] = {}
        if not self.reuse_files or not self.free.is_dir():
            return out
        for entry in sorted(os.scandir(self.free), key=lambda e: e.name):
            try:
                out.setdefault(entry.stat(follow_symlinks=False).st_size, []).append(Path(entry.path))
            except FileNotFoundError:
                continue
        return out


def _pooled(name: str) -> tuple[int, str]:
    """(counter, the name the file held) of a pooled file's name ("000000000012-model-00001-of-00003.safetensors", or a
    bare counter as older pools named them: "" for its name); counter 0 for anything else."""
    head, _, held = name.partition("-")
    return (int(head) if head.isdigit() else 0), held


def _shard_header(group: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors prefix of `group` (length and JSON header, padded so the data starts 8-byte
    aligned, as safetensors writes it) and each tensor's byte range after it."""
    from offpolicy.weights.safetensors_view import dtype_name

    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, pos = [], 0
    for name, t in group:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        offsets.append((pos, pos + n))
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def create_shard(path: Path, header: bytes, size: int, recycled: bool | None = None) -> int:
    """Open (a recycled file of exactly `size` bytes moved there) or create (mode 0600) a shard of `size`
    bytes and write its `header`; returns the open descriptor. A recycled file is not truncated: its
    size is right, and its pages stay the ones other processes may hold page-locked (maps.py).
    `recycled` None: whether `path` exists."""
    recycled = path.exists() if recycled is None else recycled
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if recycled else os.O_EXCL), 0o600)
    try:
        if not recycled or os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        os.pwrite(fd, header, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Create `path` (mode 0600, failing if it exists) holding `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
