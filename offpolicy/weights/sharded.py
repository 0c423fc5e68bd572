"""Sharded publish: every learner rank writes its own pieces of a version into its node's store; rank 0 commits.

A Megatron learner's ranks each hold distinct pieces of the model (learner/backends/megatron/shards.py says
which rank writes what). Per version, every rank runs `ShardWriter.begin` in step (the backend's
`publish` command), then its writing goes on in a background thread while the learner trains on:

1. `begin` (main thread, every rank in step): encode this rank's pieces in each format missing from
   the store (`formats.encode_piece`: quantized where they lie, the learner's GPU). The first time, every
   rank's piece list (names, dtypes, shapes, no data) is all-gathered over the publish group (gloo) and
   `layout.plan` fixes the files, the same on every rank; later versions reuse it (the pieces of a model
   never change; a change raises). `begin` queues the quantizing kernels and returns without waiting for
   them: it records a CUDA event after them (`_made`), and the writer's copies wait for that event alone,
   not for the learner's next step, which the main thread queues on the same stream meanwhile.
2. the writer thread: each file's first writer creates it in its node's staging directory
   `<store>/.v<N>.shards/` at its final size with its header (with weights.reuse_files, a file of that size
   from the store's free pool); a barrier over the publish group; then every rank `pwrite`s its pieces at
   their offsets (GPU tensors through pinned buffers, `transfer.write_files`), hashing (checksum sha256)
   the files it alone writes as it writes them.
3. every rank reports to rank 0 (its files' sha256, or its error; gather over the publish group). Rank 0
   hashes the files several ranks wrote (GPT-OSS's fused experts), writes `model.safetensors.index.json`,
   `config.json` (`formats.config_of`) and `manifest.json` last, renames the directory into place as
   `v<N>` and collects old versions; only then is the version announced (learner/loop.py).

Invariants: a version directory appears complete or not at all: if any rank fails or dies (gloo reports
the lost peer to rank 0), nothing is renamed, the staged directory is removed by rank 0 or swept by the
next learner start (`WeightStore._sweep_partial`), and `Pending.wait` raises on rank 0. At most one
version is in flight per rank: `begin` first waits for the previous one. The pieces handed to `begin` are
the writer thread's until it ends (a snapshot the training step does not touch).
Several nodes (`node_of`: each rank's node): every rank writes into the store of its own machine and
the plan keeps every file on one node (layout.py); each node's leader hashes its node's shared files,
rank 0 writes the manifest (each file's `node`) and every node's leader commits its part as
`<format's store>/node<k>/v<N>` with the whole manifest; the relay assembles the version from the
parts (relay/fetch.py). On one node the version is committed into the store itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from offpolicy.plumbing.trace import now
from offpolicy.weights import layout as layout_mod
from offpolicy.weights.formats import NATIVE, config_of, encode_piece, part_run, store_run
from offpolicy.weights.store import (
    INDEX,
    MANIFEST,
    FileEntry,
    Manifest,
    Published,
    WeightStore,
    create_shard,
    version_dir,
    write_private,
)

if TYPE_CHECKING:
    import torch

    from offpolicy.config import WeightsConfig

log = logging.getLogger("offpolicy.weights.sharded")

STAGING = ".v{version}.shards"  # a node's staging directory of a version (a hidden `.v` name: swept at start)


class Report(msgspec.Struct):
    """One rank's word to rank 0 after writing a version."""
    rank: int
    error: str = ""  # empty when every piece was written
    sums: dict[str, dict[str, str]] = {}  # format -> file -> sha256, for the files this rank alone wrote
    seconds: float = 0.0  # this rank's write time
    bytes: int = 0  # bytes this rank wrote


class Pending:
    """A version being written: `wait()` joins the writer thread; on rank 0 it returns each format's
    `Published` (or raises the reason the version was refused)."""

    def __init__(self, version: int, snapshot_seconds: float):
        self.version, self.snapshot_seconds = version, snapshot_seconds
        self.bytes = 0  # device bytes its snapshot holds
        # this rank's parts of the publish, (name, wall start, seconds): encode (begin's, on the main thread), then the
        # writer thread's create, wait for writers, write, wait for writes, seal, commit (the run's timeline shows them)
        self.phases: list[tuple[str, float, float]] = []
        self.fresh_files = 0  # files this rank created new for it, none free in the store's pool (slower to write)
        # files this rank wrote through pinned buffers, not a registered map (a GPU learner's file met for the first
        # time, or a CPU learner's): several times slower than a map's copies, beside a step or not
        self.staged_files = 0
        self.result: dict[str, Published] = {}
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def wait(self) -> dict[str, Published]:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class ShardWriter:
    """One learner rank's side of the sharded publish of run `run` (every rank builds one, in step: the
    constructor makes the publish process group)."""

    def __init__(self, w: WeightsConfig, run: str, *, rank: int, world: int, node: int = 0,
                 node_of: list[int] | None = None, root: str | None = None):
        import torch.distributed as dist

        if "fp8" in w.formats and w.fp8_block_size == "auto":  # every rank must write one block: the learner's
            raise ValueError("weights.fp8_block_size is auto here: the sharded publish needs the block the run resolved "
                             "(models.fp8_run.resolved, as the learner does at start), the same on every rank")
        self.w, self.run, self.rank, self.world, self.node = w, run, rank, world, node
        self.root = root or w.root
        self.node_of = node_of or [0] * world
        self.leader = self.node_of.index(node) == rank  # the node's lowest rank: sweeps and commits its store
        self.group = dist.new_group(backend="gloo") if world > 1 else None
        self.layouts: dict[str, layout_mod.Layout] = {}
        self._metas: dict[str, list[layout_mod.Piece]] = {}
        # this node's store of every format; the node's leader sweeps what a dead writer left staged
        self.stores = {fmt: WeightStore(self.root, store_run(run, fmt), keep=w.keep, shard_bytes=w.shard_bytes,
                                        checksum=w.checksum, reuse_files=w.reuse_files, fmt=fmt, sweep=self.leader)
                       for fmt in (NATIVE, *w.formats)}
        if self.group is not None:
            dist.barrier(group=self.group)  # swept before anyone stages a version
        self.previous: Pending | None = None
        self.maps = None
        if w.register_maps and w.reuse_files:
            from offpolicy.weights.maps import shared

            self.maps = shared(w.keep + 2)

    @property
    def idle(self) -> bool:
        """No version of this rank is being written."""
        return self.previous is None or self.previous.done

    @property
    def held_bytes(self) -> int:
        """Device bytes of the snapshot the version in flight holds (0 when idle)."""
        return 0 if self.idle else self.previous.bytes

    def store(self, fmt: str) -> WeightStore:
        return self.stores[fmt]

    def staging(self, fmt: str, version: int) -> Path:
        return self.store(fmt).dir / STAGING.format(version=version)

    def begin(self, version: int, fmts: list[str], pieces: list[tuple[str, int | None, torch.Tensor, tuple]],
              hf_config: dict) -> Pending:
        """Encode this rank's `pieces` (name, first row or None, tensor, order) in each of `fmts` and start
        writing them (see the module doc); every rank calls it in step with the same `version` and `fmts`."""
        self.join()
        t0, began = time.perf_counter(), now()
        jobs = {}
        for fmt in fmts:
            encoded = []
            for name, row, t, order in pieces:
                for k, (n, q, r) in enumerate(encode_piece(fmt, name, t, row, self.w.fp8_block_size,
                                                           self.w.fp8_skip)):
                    meta = layout_mod.Piece(name=n, dtype=_dtype_name(q.dtype), shape=tuple(q.shape),
                                            row=-1 if r is None else r, order=(*order, k), rank=self.rank,
                                            node=self.node)
                    encoded.append((meta, q.contiguous()))
            jobs[fmt] = (self._layout(fmt, [m for m, _ in encoded]), encoded)
        ready = _made([t for _, e in jobs.values() for _, t in e])
        pending = Pending(version, time.perf_counter() - t0)
        pending.phases.append(("encode", began, pending.snapshot_seconds))
        seen: set[int] = set()  # formats share what they leave unquantized
        for _, e in jobs.values():
            for _, t in e:
                if t.is_cuda and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    pending.bytes += t.untyped_storage().nbytes()
        pending.thread = threading.Thread(target=self._write, args=(pending, jobs, hf_config, ready),
                                          name=f"publish-v{version}", daemon=True)
        pending.thread.start()
        self.previous = pending
        return pending

    def join(self) -> None:
        """Wait for this rank's previous version (its error, on rank 0, was the caller's to see)."""
        if self.previous is not None and self.previous.thread is not None:
            self.previous.thread.join()

    def _layout(self, fmt: str, metas: list[layout_mod.Piece]) -> layout_mod.Layout:
        if fmt in self.layouts:
            if metas != self._metas[fmt]:
                raise RuntimeError(f"the pieces of format {fmt} changed between versions on rank {self.rank}")
            return self.layouts[fmt]
        everyone = [metas]
        if self.group is not None:
            import torch.distributed as dist

            everyone = [None] * self.world
            dist.all_gather_object(everyone, metas, group=self.group)
        from offpolicy.weights.transfer import THREADS

        writers = max(1, sum(1 for r in set(m.rank for ms in everyone for m in ms) if self.node_of[r] == self.node))
        self._metas[fmt] = metas
        self.layouts[fmt] = layout_mod.plan([m for ms in everyone for m in ms], self.w.shard_bytes,
                                            threads=max(1, THREADS // writers))
        return self.layouts[fmt]

    # -- the writer thread --------------------------------------------------------------------------
    def _write(self, pending: Pending, jobs: dict, hf_config: dict, ready=None) -> None:
        import torch.distributed as dist

        report = Report(rank=self.rank)
        t0 = time.perf_counter()

        @contextlib.contextmanager
        def phase(name: str):
            start, s0 = now(), time.perf_counter()
            try:
                yield
            finally:
                pending.phases.append((name, start, time.perf_counter() - s0))

        def attempt(work) -> None:  # a local failure is reported to rank 0, the collectives still run
            if not report.error:
                try:
                    work()
                except BaseException as e:
                    report.error = f"rank {self.rank}: {type(e).__name__}: {e}"

        def create() -> None:  # counting the files made new (the pool had none of their size)
            pending.fresh_files = sum(self._create(fmt, pending.version, lay) for fmt, (lay, _) in jobs.items())

        def fill() -> None:
            for fmt, (lay, encoded) in jobs.items():
                report.sums[fmt], n, staged = self._fill(fmt, pending.version, lay, encoded, ready)
                report.bytes += n
                pending.staged_files += staged

        def seal() -> None:  # the node's leader hashes the files of its node that several ranks wrote
            for fmt, (lay, _) in jobs.items():
                if self.leader and self.w.checksum == "sha256":
                    report.sums.setdefault(fmt, {}).update(self._hash_shared(fmt, pending.version, lay))

        try:
            with phase("create"):
                attempt(create)
            with phase("wait for writers"):
                self._barrier()  # every file exists at its size before anyone writes into it
            with phase("write"):
                attempt(fill)
            with phase("wait for writes"):
                self._barrier()  # every piece is written
            with phase("seal"):
                attempt(seal)
            report.seconds = time.perf_counter() - t0
            with phase("commit"):  # rank 0 decides, each node's leader commits, every rank hears of it
                reports = self._gather(report)
                verdict: dict | str = {}
                if self.rank == 0:
                    failed = [r.error for r in reports if r.error]
                    verdict = "; ".join(failed) if failed else \
                        {fmt: self._meta(fmt, pending.version, lay, reports, hf_config) for fmt, (lay, _) in jobs.items()}
                verdict = self._share(verdict)
                if isinstance(verdict, str):
                    raise RuntimeError(f"weight version {pending.version} refused: {verdict}")
                done = ""
                if self.leader:
                    try:
                        for fmt, (lay, _) in jobs.items():
                            pending.result[fmt] = self._commit(fmt, pending.version, lay, verdict[fmt], t0)
                    except BaseException as e:
                        done = f"rank {self.rank}: {type(e).__name__}: {e}"
                late = [d for d in self._gather(done) if d]  # every rank takes part; rank 0 gets the list
            if late:
                raise RuntimeError(f"weight version {pending.version} not committed on every node: " + "; ".join(late))
        except BaseException as e:  # the version stays invisible; rank 0's learner sees it in Pending.wait
            pending.error = e
            log.error("weight version %d not published: %s", pending.version, e)
            if self.leader:
                for fmt in jobs:
                    _remove(self.staging(fmt, pending.version))

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _gather(self, obj) -> list:
        """Every rank's `obj` on rank 0 (in rank order; [] elsewhere)."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out or []

    def _share(self, obj):
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _create(self, fmt: str, version: int, lay: layout_mod.Layout) -> int:
        """Create the files of `fmt` this rank writes first (from the store's pool where one of a file's size is
        free); returns how many were created new."""
        fresh = 0
        d = self.staging(fmt, version)
        d.mkdir(mode=0o700, exist_ok=True)
        for i in lay.files_of(self.rank):
            f = lay.files[i]
            if f.writers[0] != self.rank:
                continue
            path = d / f.name
            recycled = self.store(fmt).take_free(f.size, path)
            os.close(create_shard(path, f.header, f.size, recycled=recycled))
            fresh += not recycled
        return fresh

    def _fill(self, fmt: str, version: int, lay: layout_mod.Layout, encoded,
              ready=None) -> tuple[dict[str, str], int, int]:
        """Write this rank's pieces of `fmt` into their files (GPU copies after the event `ready`: `_made`);
        returns the sha256 of the files it alone wrote, the bytes of its pieces and how many of its files were
        written staged (through pinned buffers: no registered map held them after the write)."""
        from offpolicy.weights.transfer import flat_bytes, write_files

        d = self.staging(fmt, version)
        by_file: dict[int, list] = {}
        for meta, t in encoded:
            i, offset = lay.where[(meta.name, meta.row)]
            if t.numel():
                by_file.setdefault(i, []).append((flat_bytes(t), offset))
        checksum = self.w.checksum == "sha256"
        files, names = [], []
        try:
            for i in lay.files_of(self.rank):
                f = lay.files[i]
                fd = os.open(d / f.name, os.O_RDWR)
                files.append((fd, f.size, by_file.get(i, []), checksum and f.writers == (self.rank,)))
                names.append(f.name)
            sums = write_files(files, maps=self.maps, after=ready, gap=self.w.publish_gap_mib << 20)
            staged = sum(1 for fd, _, pieces, _ in files if pieces and (self.maps is None or fd not in self.maps))
        finally:
            for fd, *_ in files:
                os.close(fd)
        return {n: s for n, s in zip(names, sums) if s}, sum(t.numel() * t.element_size() for _, t in encoded), staged

    def _hash_shared(self, fmt: str, version: int, lay: layout_mod.Layout) -> dict[str, str]:
        """sha256 of this node's files that several ranks wrote (complete now: after the barrier)."""
        from offpolicy.weights.transfer import hash_fd

        out = {}
        for f in lay.files:
            if f.node == self.node and len(f.writers) > 1:
                fd = os.open(self.staging(fmt, version) / f.name, os.O_RDONLY)
                try:
                    out[f.name] = hash_fd(fd, f.size)
                finally:
                    os.close(fd)
        return out

    def _meta(self, fmt: str, version: int, lay: layout_mod.Layout, reports: list[Report], hf_config: dict) -> dict:
        """Rank 0: the version's index, config.json and manifest (bytes), from every rank's report."""
        import json

        sums = {n: s for r in reports for n, s in r.sums.get(fmt, {}).items()}
        several = len({f.node for f in lay.files}) > 1
        files = {f.name: FileEntry(bytes=f.size, sha256=sums.get(f.name, ""), node=f.node) for f in lay.files}
        meta = {INDEX: json.dumps(lay.index(), indent=2).encode(),
                "config.json": json.dumps(config_of(fmt, hf_config, lay.specs, self.w.fp8_block_size), indent=2).encode()}
        for name, data in meta.items():
            files[name] = FileEntry(bytes=len(data), sha256=_sha256(data) if self.w.checksum == "sha256" else "")
        manifest = Manifest(version=version, created_unix=time.time(), total_bytes=lay.total_bytes,
                            num_tensors=lay.num_tensors, files=files, checksum=self.w.checksum, format=fmt,
                            nodes=len({f.node for f in lay.files}) if several else 1)
        return {**meta, MANIFEST: msgspec.json.encode(manifest)}

    def part_run(self, fmt: str) -> str:
        """The store (run name) this node commits a version of `fmt` into: the format's own on one node;
        on several, `<format's run>/node<k>`, a part that only the relay reads (no node holds it all)."""
        return part_run(self.run, fmt, self.node if len(set(self.node_of)) > 1 else None)

    def _commit(self, fmt: str, version: int, lay: layout_mod.Layout, meta: dict[str, bytes], t0: float) -> Published:
        """A node's leader: the metadata files (manifest last) into the staged directory, then the rename
        into place (this node's part of it, on several nodes), then old versions collected."""
        d = self.staging(fmt, version)
        for name, data in meta.items():  # dict order: the manifest last
            write_private(d / name, data)
        run = self.part_run(fmt)
        final = version_dir(self.root, run, version)
        if final.exists():
            raise FileExistsError(f"weight version {version} already exists at {final}")
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        committed = now()
        os.rename(d, final)
        store = self.store(fmt) if run == store_run(self.run, fmt) else self._part(fmt, run)
        store.collect()
        return Published(version=version, path=str(final), total_bytes=lay.total_bytes,
                         seconds=time.perf_counter() - t0, committed=committed)

    def _part(self, fmt: str, run: str) -> WeightStore:
        key = f"part:{fmt}"
        if key not in self.stores:
            self.stores[key] = WeightStore(self.root, run, keep=self.w.keep, fmt=fmt, sweep=False)
        return self.stores[key]


def _dtype_name(dtype) -> str:
    from offpolicy.weights.safetensors_view import dtype_name

    return dtype_name(dtype)


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _made(tensors: list):
    """A CUDA event after the kernels that made the pieces (gathers, quantizing) on the caller's stream: the
    writer thread's copies wait for it, so `begin` returns without waiting for them (a low-bit version's
    quantizing is not the learner's stall) and the copies wait for nothing the learner queues afterwards
    (its next step). None for host pieces. Pieces on several GPUs (not a learner rank's): waited for here."""
    import torch

    devices = {t.device for t in tensors if t.is_cuda}
    if len(devices) > 1:
        for device in devices:
            torch.cuda.synchronize(device)
        return None
    if not devices:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(devices.pop()))
    return event


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
