"""Bulk byte copies between tensors, in parallel chunks: the weight store's writer and the engines' loader.

`copy_bytes(pairs)` copies each (source, destination) pair of equally sized tensors, cut into chunks
of `CHUNK` bytes that a thread pool copies concurrently (the copies release the GIL). `write_files`
writes tensors into files (the weight store's shards) with `pwrite`, `read_files` reads them back
with `preadv`: no maps, so no page fault per 4 KiB, which costs more than the copy itself.
Host to host is a plain copy. A CUDA source or destination is staged through pinned host buffers
("slots", each with its own CUDA stream): device -> pinned -> file for a publish, file -> pinned ->
device for a load. Copying straight between a GPU and pageable memory (such as a map of a file in
/dev/shm) runs far below the bus speed; through pinned memory it runs at bus speed, and the bus
transfer of one chunk overlaps the host-side work on another. The slots are kept for the process's
life (pinning memory is slow), so every later version reuses them.

Registered maps (`maps=`, a `maps.MapCache`; `weights.register_maps`): a file that this process has
met before (with `weights.reuse_files` the store recycles the shard files of collected versions) is
mapped and page-locked once and kept; its copies then skip the staging: the GPU copies each tensor
straight into the map (publish: one stream, asynchronous, then one wait) or straight out of it into
the destination (load). Files met for the first time, host tensors, and any file whose map could not
be registered take the staged path, which is unchanged (and the only one without CUDA).

Checksums (sha256) are computed by the writer threads from the bytes they just wrote, chunk by chunk
in file order (the next GPU chunk crosses the bus meanwhile), instead of a second read of every file
afterwards; a file written through its map is hashed from the map, each chunk once its copy is done.
`profile.stage` records where the time goes (`offpolicy bench weights` prints it).

`load_version(dest, path)` reads a published version into a module's state (same names, shapes): the
rollout engine's swap to a new version; `load_into(dest, src)` does the same from tensors.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from offpolicy.weights.gaps import CopyGaps
from offpolicy.weights.maps import copies_after, device_index, finish_write, issue_read, issue_write, map_device
from offpolicy.weights.profile import count, stage

CHUNK = 32 << 20  # bytes per copy job and per pinned staging buffer
THREADS = max(1, min(16, os.cpu_count() or 1))


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (a view, no copy)."""
    if not t.is_contiguous():
        raise ValueError("flat_bytes needs a contiguous tensor")
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def copy_bytes(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int | None = None) -> None:
    """Copy every (src, dst) pair of flat uint8 tensors of equal length, in parallel chunks."""
    jobs = []
    for src, dst in pairs:
        if src.numel() != dst.numel():
            raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
        jobs += [(_copy, src[off:off + CHUNK], dst[off:off + CHUNK]) for off in range(0, src.numel(), CHUNK)]
    _run(jobs, threads)


def write_files(files: list[tuple[int, int, list[tuple[torch.Tensor, int]], bool]],
                threads: int | None = None, maps=None, after: torch.cuda.Event | None = None,
                gap: int = 0) -> list[str]:
    """Write each file's (flat uint8 tensor, offset) pieces with `pwrite`, one thread per file (writes
    into one file are serialised by the kernel anyway), and return each file's sha256 (hex; "" where its
    flag is False). A file is (fd, size, pieces, checksum); its size is set and whatever the pieces do
    not cover (the safetensors header) is written already. `pwrite` into shared memory allocates the
    pages without a page fault each, which makes it faster than writing through a map (measured). GPU
    chunks go through pinned buffers; each chunk is hashed right after it was written, in file order.
    With `maps`, a file of GPU tensors that `maps` holds registered is written by the GPU straight
    into its map instead (see the module doc); the others as above. `after`: a CUDA event the producer
    recorded once the GPU sources were made; the copies wait for it alone, not for everything the default
    stream has queued meanwhile (a learner's next step, when the writer is a background thread). `gap`: the
    copies into maps leave the copy engine to other streams every `gap` bytes (`gaps.CopyGaps`; 0 = never)."""
    plans = [_ordered(pieces, size) for _, size, pieces, _ in files]
    mapped: list = [None] * len(files)
    issued: dict[int, tuple] = {}
    try:
        if maps is not None:
            devices: list = [None] * len(files)
            with stage("write.maps"):  # which files have a registered map (page-locking those met again)
                maps.sweep()
                for i, ((fd, _, pieces, _), (_, inorder)) in enumerate(zip(files, plans)):
                    devices[i] = map_device(maps, [src for src, _ in pieces]) if inorder and pieces else None
                    if devices[i] is not None:
                        mapped[i] = maps.take(fd, devices[i], writable=True)
            with stage("write.issue"):
                gaps = CopyGaps(gap)  # one for all files: their copies follow each other on the map stream
                for i, e in enumerate(mapped):
                    if e is not None:
                        issued[i] = issue_write(e, plans[i][0], files[i][3], devices[i], after, gaps)
                if gaps.count:
                    count("write.gaps", gaps.count)
        for i, (_, size, _, _) in enumerate(files):
            count("files.direct" if mapped[i] is not None else "files.staged")
            count("bytes.direct" if mapped[i] is not None else "bytes.staged", size)
        # staged files, and files written through a map that are hashed from it, on the pool; the
        # others are only waited for (below, once for all)
        jobs = {i: (_write_file, fd, size, pieces, checksum, after) if mapped[i] is None else
                (finish_write, mapped[i], size, issued[i], checksum)
                for i, (fd, size, pieces, checksum) in enumerate(files) if mapped[i] is None or checksum}
        sums = dict(zip(jobs, _run(list(jobs.values()), threads)))
        return [sums.get(i, "") for i in range(len(files))]
    finally:
        if maps is not None:
            with stage("write.dma_wait"):
                for _, done in issued.values():  # nothing may still be copying into a map given back
                    if done is not None:
                        done.synchronize()
            maps.give([e for e in mapped if e is not None], sum(size for _, size, _, _ in files))


def _ordered(pieces: list[tuple[torch.Tensor, int]], size: int):
    """Chunks (src, offset) of the pieces in file order, and whether they never overlap and stay in the file
    (then a checksum can be computed in that order, gaps read from the file)."""
    chunks = sorted(((src[off:off + CHUNK], offset + off) for src, offset in pieces
                     for off in range(0, src.numel(), CHUNK)), key=lambda c: c[1])
    pos, ok = 0, True
    for src, offset in chunks:
        ok = ok and offset >= pos
        pos = max(pos, offset + src.numel())
    return chunks, ok and pos <= size


class _Hasher:
    """sha256 of a file computed while it is written: `add(offset, bytes)` in increasing offsets; the
    bytes between the pieces (the header) are read from the file."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.pos, self.h = fd, size, 0, hashlib.sha256()

    def add(self, offset: int, data) -> None:
        self._gap(offset)
        self.h.update(data)  # hashlib drops the GIL for large buffers
        self.pos = offset + len(data)

    def _gap(self, upto: int) -> None:
        while self.pos < upto:
            n = min(CHUNK, upto - self.pos)
            self.h.update(os.pread(self.fd, n, self.pos))
            self.pos += n

    def hexdigest(self) -> str:
        self._gap(self.size)
        return self.h.hexdigest()


def hash_fd(fd: int, size: int) -> str:
    """sha256 of the first `size` bytes of an open file (read in chunks with pread)."""
    return _Hasher(fd, size).hexdigest()


def _write_file(fd: int, size: int, pieces: list[tuple[torch.Tensor, int]], checksum: bool,
                after: torch.cuda.Event | None = None) -> str:
    """One file's pieces in order with `pwrite`, each chunk hashed right after it was written. GPU chunks
    alternate between two pinned slots, so the next chunk crosses the bus while this thread writes (and
    hashes) the previous one; they wait for the event `after` (`write_files`), or without one for the
    default stream, where the sources were written."""
    chunks, inorder = _ordered(pieces, size)
    hasher = _Hasher(fd, size) if checksum and inorder else None
    gpu = next((src.device for src, _ in chunks if src.is_cuda), None)

    def written(src: torch.Tensor, offset: int) -> None:
        with stage("write.pwrite"):
            _pwrite(fd, src, offset)
        if hasher is not None:
            with stage("write.hash"):
                hasher.add(offset, src.numpy())

    def flush(pending) -> None:
        slot, n, offset = pending
        with stage("write.d2h_wait"):
            slot.event.synchronize()
        written(slot.buf[:n], offset)

    if gpu is None:
        for src, offset in chunks:
            written(src, offset)
    else:
        with _slot(gpu) as a, _slot(gpu) as b:
            pending = None
            for src, offset in chunks:
                if not src.is_cuda:  # the chunk before it first: the hash goes in file order
                    if pending is not None:
                        flush(pending)
                        pending = None
                    written(src, offset)
                    continue
                slot = b if pending is not None and pending[0] is a else a  # not the one still to be written
                with torch.cuda.stream(slot.stream):
                    copies_after(slot.stream, after, torch.cuda.default_stream(gpu))  # the source was written there
                    slot.buf[: src.numel()].copy_(src, non_blocking=True)
                    slot.event = torch.cuda.Event()
                    slot.event.record(slot.stream)
                if pending is not None:
                    flush(pending)
                pending = (slot, src.numel(), offset)
            if pending is not None:
                flush(pending)
    if not checksum:
        return ""
    with stage("write.hash"):
        return hasher.hexdigest() if hasher is not None else hash_fd(fd, size)


def _pwrite(fd: int, src: torch.Tensor, offset: int) -> None:
    view = memoryview(src.numpy())
    done = 0
    while done < len(view):  # pwrite may write less than asked
        done += os.pwrite(fd, view[done:], offset + done)


def read_files(files: list[tuple[int, list[tuple[int, torch.Tensor]]]], threads: int | None = None, maps=None,
               extent: int | None = None) -> int:
    """Fill each flat uint8 tensor from its file at its offset ((fd, [(offset, dst), ...]) per file) with
    `preadv`, in parallel chunks: reads of one file run concurrently, need no map of it (a map costs a
    page fault per 4 KiB) and, for a GPU destination, land straight in the thread's pinned buffer, whose copy is
    ordered on the caller's current stream (a background load's own), whichever pool thread issues it.
    With `maps`, a file whose destinations are on one GPU and that `maps` holds registered is copied by
    the GPU straight out of its map instead (one stream, asynchronous; waited for before returning). `extent`: the
    bytes of the whole read (a version) this call is one part of (a shard, a window), which `maps` bounds itself by
    (`MapCache.give`: versions times a version's bytes); this call's bytes where None (a call that reads a version).
    Returns the bytes copied out of registered maps (the rest went through the reader's buffers)."""
    mapped: list = [None] * len(files)
    devices: list = [None] * len(files)
    streams = set()
    try:
        if maps is not None:
            with stage("read.maps"):
                maps.sweep()
                for i, (fd, pieces) in enumerate(files):
                    devices[i] = map_device(maps, [dst for _, dst in pieces]) if pieces else None
                    e = maps.take(fd, devices[i], writable=False) if devices[i] is not None else None
                    if e is not None and any(offset + dst.numel() > e.size for offset, dst in pieces):
                        maps.give([e], 0)  # the header says more than the file holds: preadv will tell
                        e = None
                    mapped[i] = e
            with stage("read.issue"):
                for e, device, (_, pieces) in zip(mapped, devices, files):
                    if e is not None:
                        streams |= issue_read(e, pieces, device)
        direct = 0  # bytes copied out of registered maps (returned)
        for e, (_, pieces) in zip(mapped, files):
            n = sum(dst.numel() for _, dst in pieces)
            direct += n if e is not None else 0
            count("files.direct" if e is not None else "files.staged")
            count("bytes.direct" if e is not None else "bytes.staged", n)
        # the caller's current stream on each GPU (a background load's own): the pool's threads would take the default
        callers = {d: torch.cuda.current_stream(d) for d in {dst.device for _, pieces in files for _, dst in pieces
                                                              if dst.is_cuda}}
        jobs = [(_read, fd, offset + off, dst[off:off + CHUNK], callers.get(dst.device))
                for e, (fd, pieces) in zip(mapped, files) if e is None
                for offset, dst in pieces for off in range(0, dst.numel(), CHUNK)]
        _run(jobs, threads)
        return direct
    finally:
        if maps is not None:
            with stage("read.dma_wait"):
                for stream in streams:  # nothing may still be copying out of a map given back
                    stream.synchronize()
            moved = sum(dst.numel() for _, pieces in files for _, dst in pieces)
            maps.give([e for e in mapped if e is not None], moved if extent is None else max(extent, moved))


def _read(fd: int, offset: int, dst: torch.Tensor, caller=None) -> None:
    if not dst.is_cuda:
        with stage("read.preadv"):
            _pread(fd, dst, offset)
        return
    with _slot(dst.device) as slot:  # the copy to the GPU runs on while this thread reads the next chunk
        buf = slot.buf[: dst.numel()]
        with stage("read.preadv"):
            _pread(fd, buf, offset)
        if caller is None:  # the default stream, or a background load's own
            caller = torch.cuda.current_stream(dst.device)
        with torch.cuda.stream(slot.stream):
            slot.stream.wait_stream(caller)  # dst may still be read there
            dst.copy_(buf, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(slot.stream)
        caller.wait_event(slot.event)  # what the caller queues next (or a wait for its stream) comes after the copy


def _pread(fd: int, dst: torch.Tensor, offset: int) -> None:
    view = memoryview(dst.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends {len(view) - done} bytes early at offset {offset + done}")
        done += n


def _run(jobs: list[tuple], threads: int | None) -> list:
    """Run (fn, *args) jobs on up to `threads` threads (None: THREADS, read at the call); their results in order."""
    threads = THREADS if threads is None else threads
    if threads <= 1 or len(jobs) <= 1:
        return [fn(*args) for fn, *args in jobs]
    mode = torch.is_inference_mode_enabled()  # thread-local: a caller's inference tensors are written in its mode
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
        return [f.result() for f in [pool.submit(_in_mode, mode, *job) for job in jobs]]


def _in_mode(inference: bool, fn, *args):
    with torch.inference_mode(inference):
        return fn(*args)


def _copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.is_cuda and dst.is_cuda:
        dst.copy_(src)
        return
    if not src.is_cuda and not dst.is_cuda:
        _host_copy(src, dst)
        return
    gpu = src.device if src.is_cuda else dst.device
    with _slot(gpu) as slot, torch.cuda.stream(slot.stream):
        buf = slot.buf[: src.numel()]
        if src.is_cuda:  # device -> pinned -> host memory
            slot.stream.wait_stream(torch.cuda.default_stream(gpu))  # the source was written there
            buf.copy_(src, non_blocking=True)
            slot.stream.synchronize()
            _host_copy(buf, dst)
        else:  # host memory -> pinned -> device
            _host_copy(src, buf)
            dst.copy_(buf, non_blocking=True)
            slot.stream.synchronize()


def _host_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """One thread's memcpy (numpy's copy drops the GIL and, unlike torch's, starts no threads of its
    own, which would oversubscribe the cores under our pool)."""
    np.copyto(dst.numpy(), src.numpy())


class _Slot:
    """A pinned staging buffer with its CUDA stream, and the event its last copy to the GPU records."""

    def __init__(self, device: int):
        self.buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream(device=device)
        self.event: torch.cuda.Event | None = None


_slots: dict[tuple[int, int], list[_Slot]] = {}  # (device, CHUNK): free slots
_slots_lock = threading.Lock()


@contextmanager
def _slot(device: torch.device):
    """A free slot for `device` (made on first need, then kept for the process's life), once the copy
    its previous user started from it has finished."""
    key = (device_index(device), CHUNK)  # tests change CHUNK
    with _slots_lock:
        free = _slots.setdefault(key, [])
        slot = free.pop() if free else None
    if slot is None:
        slot = _Slot(key[0])
    if slot.event is not None:
        with stage("slot_wait"):
            slot.event.synchronize()
    try:
        yield slot
    finally:
        with _slots_lock:
            _slots[key].append(slot)


def load_into(dest: dict[str, torch.Tensor], src: dict[str, torch.Tensor], threads: int | None = None) -> None:
    """Copy `src[name]` into `dest[name]` for every name in `src` (shapes must match). Same-dtype
    contiguous pairs go through `copy_bytes`; others (a dtype cast) are copied one by one."""
    pairs, seen = [], set()
    with torch.no_grad():
        for name, s in src.items():
            d = dest[name]
            if d.shape != s.shape:
                raise ValueError(f"{name}: shape {tuple(s.shape)} does not fit {tuple(d.shape)}")
            if d.data_ptr() in seen and d.numel():
                continue  # tied to a tensor already copied
            seen.add(d.data_ptr())
            if d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous():
                pairs.append((flat_bytes(s), flat_bytes(d)))
            else:
                d.copy_(s)
        copy_bytes(pairs, threads)
    _sync({d.device for d in dest.values() if d.is_cuda})


def load_version(dest: dict[str, torch.Tensor], path, threads: int | None = None, maps=None, sync: bool = True) -> None:
    """Copy every tensor of the weight version at `path` into `dest[name]` (shapes must match), reading
    the shards with `read_files` (through registered maps where `maps`, a `maps.MapCache`, holds them);
    a tensor of another dtype than its destination is cast on the way. The caller holds the version
    (`WeightVersion`), so the store cannot recycle its files meanwhile. On a GPU it returns once every copy
    is done (a device-wide wait), or with `sync=False` once they are all queued before anything the caller's
    current stream runs next: a background load on its own stream then waits for that stream alone (the
    torch engine's double buffer), not for the generation running beside it."""
    from pathlib import Path

    from offpolicy.weights.safetensors_view import map_tensors, read_header, torch_dtype

    files, cast = [], []
    with torch.no_grad():
        try:
            with stage("load.open"):
                for shard in sorted(Path(path).glob("*.safetensors")):
                    header, base = read_header(shard)
                    pieces = []
                    for name, info in header.items():
                        if name == "__metadata__":
                            continue
                        d = dest[name]
                        if list(d.shape) != list(info["shape"]):
                            raise ValueError(f"{name}: shape {tuple(info['shape'])} does not fit {tuple(d.shape)}")
                        begin, end = info["data_offsets"]
                        if d.dtype == torch_dtype(info["dtype"]) and d.is_contiguous():
                            if end > begin:
                                pieces.append((base + begin, flat_bytes(d)))
                        else:
                            cast.append((shard, name))
                    files.append((os.open(shard, os.O_RDONLY), pieces))
            with stage("load.read"):
                read_files(files, threads, maps)
        finally:
            for fd, _ in files:
                os.close(fd)
        with stage("load.cast"):
            for shard in {s for s, _ in cast}:
                mapped = map_tensors(shard)
                for s, name in cast:
                    if s == shard:
                        dest[name].copy_(mapped[name])
    if sync:
        with stage("load.sync"):
            _sync({d.device for d in dest.values() if d.is_cuda})


def _sync(devices: set[torch.device]) -> None:
    """Wait for the copies to these GPUs (they ran on the slots' streams) before anyone reads them."""
    for device in devices:
        torch.cuda.synchronize(device)
