"""A weight version staged for an engine's load: its tensors read by offpolicy's reader into memory the engine keeps,
so that the engine's load takes them as tensors and reads no file.

Who stages: vLLM's workers (`vllm/worker.py`, `rollout.vllm.prefetch`, the rule in `vllm/where.py`: vLLM's
`reload_weights(weights_iterator=...)` takes the tensors) and the in-process SGLang engine (`sglang/staged.py`,
`rollout.sglang.prefetch`: `update_weights_from_tensor` takes them, its workers copying them device to device).
Why: the engines' own loads read the safetensors files (a map of each file, pageable host tensors, then a copy per
tensor to the GPU) while the engine is paused: on the rollout's critical path. Staged ahead (in a thread beside
generation, `background.py`), the load's copies come from the GPU itself ("device") or from page-locked host memory
("host"), and the caller's `fingerprint` hashes the staged tensors once they are read (vLLM: the files' half of the
load's proof; the staged bytes are the files' bytes). `windows` stages nothing: at the load it reads the version onto
the engine's device a window of tensors at a time, as the engine takes them (vLLM's `rollout.vllm.prefetch=direct`).
After the read and the hash a caller's `Prepare` may make the engine's ready tensors of the version ahead as well
(vLLM's MXFP4 experts swizzled as their kernels hold them, `vllm/kernels.prepare`), where the GPU has room for them.

Invariants:
- One buffer (`Arena`) per stager, reused by every version that fits in it (a model's versions have one size); it grows
  when a version needs more. One staging at a time writes it: a new one first tells the one before it to stop
  (`Stager.begin`) and waits for it (`Stager.stage`).
- Each tensor lies at an offset aligned to ALIGN bytes, as a view of its checkpoint dtype and shape; the tensors are
  listed shard by shard (sorted), by name within a shard (safetensors' own order), as vLLM's reader lists them.
- Loaders may write into the tensors they are given (vLLM's GPT-OSS zeroes `w2_bias` on TP ranks other than 0, 0.32
  `models/gpt_oss.py:1254`): each staging reads the version again, whole. A change that mattered would fail the load's
  proof.
- Room is checked before any allocation (`room`): a staging that does not fit raises `StagingRefused`, naming the
  engine's setting and the fix (`Names`); the load then reads the files itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.gpu_room import DEVICE_RESERVE, fits
from offpolicy.weights.room import mem_available
from offpolicy.weights.safetensors_view import read_header, torch_dtype
from offpolicy.weights.transfer import read_files

log = logging.getLogger("offpolicy.staging")

ALIGN = 256  # bytes: each staged tensor's offset in the arena (any dtype's, and the GPU's copy alignment)
HOST_SHARE = 0.9  # host: the staged copy may take this share of the host's available memory
WINDOW = 256 << 20  # `windows`: bytes of tensors read onto the device at a time


@dataclass(frozen=True)
class Names:
    """The engine's fields a refusal names: its staging setting, where the engine's memory share is set, the setting
    that stages nowhere, and where else a version too large for the GPU may be staged ("" where nowhere else)."""
    setting: str
    memory: str
    nowhere: str
    elsewhere: str = ""


VLLM = Names("rollout.vllm.prefetch", "rollout.vllm.gpu_memory_utilization", "hash",
             " or rollout.vllm.prefetch=host (page-locked host memory)")


class StagingRefused(RuntimeError):
    """A staging that does not fit where the engine's setting (`Names.setting`) puts it (the message names the field
    and the fix)."""


class Cancelled(RuntimeError):
    """A staging told to stop: a newer version was asked for."""


@dataclass(frozen=True)
class Piece:
    shard: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int  # where its bytes start in the shard file
    nbytes: int
    offset: int  # where it lies in the arena


def plan(path: str | Path) -> tuple[list[Piece], int]:
    """Every tensor of the version at `path` with its place in an arena, and the arena bytes it needs."""
    pieces, end = [], 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        header, base = read_header(shard)
        for name in sorted(k for k in header if k != "__metadata__"):
            info = header[name]
            begin, stop = info["data_offsets"]
            pieces.append(Piece(str(shard), name, torch_dtype(info["dtype"]), tuple(info["shape"]), base + begin,
                                stop - begin, end))
            end += _aligned(stop - begin)
    return pieces, end


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def window_plan(path: str | Path, keep: Callable[[str], bool] | None = None, window: int = WINDOW,
                pieces: list[Piece] | None = None) -> list[list[Piece]]:
    """The tensors of the version at `path` (those whose name `keep` keeps) in the staged order, cut into windows of
    at most `window` bytes (a larger tensor alone; empty tensors join the next), each piece at its place in its
    window's buffer. `pieces`: the version's `plan` where the caller has it (a load reads the version several times,
    the replay of what vLLM's reload misses once a layer: its headers are then read once)."""
    out: list[list[Piece]] = []
    group: list[Piece] = []
    end = 0
    for p in [q for q in (plan(path)[0] if pieces is None else pieces) if keep is None or keep(q.name)]:
        if group and end and end + _aligned(p.nbytes) > window:
            out.append(group)
            group, end = [], 0
        group.append(replace(p, offset=end))
        end += _aligned(p.nbytes)
    return out + [group] if group else out


def read_window(path: str | Path, group: list[Piece], device: torch.device,
                maps=None, extent: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of one window of `window_plan`, read by offpolicy's reader into a buffer of its own on `device`
    (the copies done when it returns; `maps` and `extent`, the bytes of all the windows read together, as in
    `_fill`)."""
    last = group[-1]
    buf = torch.empty(last.offset + _aligned(last.nbytes), dtype=torch.uint8, device=device)
    _fill(buf, group, str(path), maps=maps, extent=extent)
    if buf.is_cuda:
        torch.cuda.current_stream(device).synchronize()
    return [(p.name, _view(buf, p)) for p in group]


def windows(path: str | Path, device: torch.device, keep: Callable[[str], bool] | None = None,
            window: int = WINDOW, pieces: list[Piece] | None = None, maps=None):
    """(name, tensor) of the version at `path` (those whose name `keep` keeps), read onto `device` a window at a time
    (`window_plan`, `read_window`): nothing is staged ahead and this reader holds nothing past the window it yields
    (vLLM's `rollout.vllm.prefetch=direct`: its loaders then slice and permute tensors on the GPU, and memory is freed
    as they let go of them; `pieces` as in `window_plan`, `maps` as in `_fill`)."""
    pieces = plan(path)[0] if pieces is None else pieces
    extent = files_bytes(pieces)  # the version's, whatever `keep` keeps of it
    for group in window_plan(path, keep, window, pieces):
        yield from read_window(path, group, device, maps, extent)


def files_bytes(pieces: list[Piece]) -> int:
    """Bytes of the shard files `pieces` lie in (a version's): what registered maps of them hold (`_fill`'s
    `extent`)."""
    return sum(os.path.getsize(shard) for shard in {p.shard for p in pieces})


class HashedAsRead:
    """The files' half of a `direct` load's proof, hashed from the tensors the load reads as it takes them (`through`:
    each the first time its name passes, before the engine's loaders, which may write into them), so that the version
    is read once: a hash ahead read it a second time beside the load, which waited for it (docs/vllm.md, "Staged
    loads"). `fingerprint`: (name, tensor) pairs -> their fingerprint."""

    def __init__(self, fingerprint: Callable):
        self.fingerprint = fingerprint
        self.seen: dict[str, int] = {}  # name -> its fingerprint
        self.seconds = 0.0

    def through(self, tensors):
        """`tensors`, each hashed before it is handed on."""
        for name, t in tensors:
            if name not in self.seen:
                t0 = time.perf_counter()
                self.seen[name] = self.fingerprint(((name, t),))
                self.seconds += time.perf_counter() - t0
            yield name, t

    def total(self, names: list[str], read: Callable[[Callable[[str], bool]], Any]) -> int:
        """The fingerprint of the tensors `names` (the version's), those the load never took read now by
        `read(keep)` (the (name, tensor) pairs of the names `keep` keeps) and hashed."""
        rest = {n for n in names if n not in self.seen}
        if rest:
            t0 = time.perf_counter()
            self.seen.update((n, self.fingerprint(((n, t),))) for n, t in read(rest.__contains__))
            self.seconds += time.perf_counter() - t0
        missing = sorted(n for n in names if n not in self.seen)
        if missing:
            raise ValueError(f"{len(missing)} tensors of the version were never read: {', '.join(missing[:5])}")
        return fp.total(self.seen[n] for n in names)


def device_free(device: torch.device) -> int:
    """Bytes of the GPU `device` this process can allocate now: the driver's free memory and what torch's caching
    allocator keeps unused (reserved, not allocated: memory a freed tensor left, which the allocator hands out again or
    releases when an allocation needs it). The driver's count alone shrinks by every freed window or hash chunk kept
    in the cache: a likely cause of vLLM's `auto` reading versions `direct` on a GPU after it had staged the version
    before them on the device (docs/vllm.md, "Staged loads")."""
    return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))


def available_host_bytes() -> int:
    """The host's available memory (`weights.room.mem_available`; the physical memory where it is unknown)."""
    available = mem_available()
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def room(where: str, need: int, device: torch.device, available: int, free: int | None, names: Names = VLLM,
         share: float = 1.0) -> None:
    """Raise StagingRefused when `need` more bytes do not fit `where` ("host": `available` host bytes; "device" on a
    GPU: `free` bytes of it, `gpu_room.fits`, within `share` of them: below 1 where the engine's `auto` stages only
    with room to spare). Nothing more (the arena held already fits the version) always fits: on a GPU the server's
    pool had left less than the reserve free, and a version that needed no new byte was refused (docs/benchmarks.md)."""
    if need <= 0:
        return
    gib = need / 2**30
    if where == "device" and device.type == "cuda" and share < 1 and free is not None and not fits(need, free, share):
        reserve = DEVICE_RESERVE / 2**30
        raise StagingRefused(f"{names.setting}=auto: the version's {gib:.2f} GiB and a {reserve:.0f} GiB reserve "
                             f"would take more than {share:.0%} of the {free / 2**30:.2f} GiB free on {device} "
                             f"beside the engine, so it is not staged there ({names.setting}=device stages it where it "
                             f"fits at all; lower {names.memory} to make room)")
    if where == "device" and device.type == "cuda":
        if free is not None and not fits(need, free):
            raise StagingRefused(f"{names.setting}=device: staging the version takes {gib:.2f} GiB more of the GPU "
                                 f"({device}), which has {free / 2**30:.2f} GiB free beside the engine; leave room for "
                                 f"it (lower {names.memory}) or use {names.setting}={names.nowhere} (the engine reads "
                                 f"the files at the load){names.elsewhere}")
    elif need > HOST_SHARE * available:
        raise StagingRefused(f"{names.setting}={where}: staging the version takes {gib:.2f} GiB more of host memory, "
                             f"which has {available / 2**30:.2f} GiB available; use {names.setting}={names.nowhere} "
                             "(the engine reads the files at the load), or give the host more memory")


class Arena:
    """The staging buffer of one worker: a flat uint8 tensor on the GPU ("device") or in host memory ("host";
    page-locked with cudaHostRegister where the worker has a GPU: a copy from it runs at the bus's speed)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buf: torch.Tensor | None = None
        self.where = ""
        self.pinned = False

    def held(self, where: str) -> int:
        """Bytes already held for `where` (0 where they are elsewhere)."""
        return self.buf.numel() if self.buf is not None and self.where == where else 0

    def take(self, where: str, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of at least `nbytes` where asked: the held one if it fits there, else a new one."""
        if self.held(where) >= nbytes:
            return self.buf
        self.release()
        on_gpu = self.device.type == "cuda"
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device if where == "device" else "cpu")
        self.where = where
        if where == "host" and on_gpu:
            from offpolicy.weights.maps import host_register

            err = host_register(self.buf.data_ptr(), nbytes, self.device)
            self.pinned = err is None
            if err is not None:  # still correct, only slower: a pageable copy
                log.warning("could not page-lock the %d-byte staging buffer (%s); its copies to the GPU run from "
                            "pageable memory", nbytes, err)
        return self.buf

    def release(self) -> None:
        if self.buf is not None and self.pinned:
            from offpolicy.weights.maps import host_unregister

            host_unregister(self.buf.data_ptr(), self.device)
        self.buf, self.where, self.pinned = None, "", False


@dataclass
class Staged:
    """A version staged in a worker's arena: its (name, tensor) in vLLM's reader's order, and the files' fingerprint."""
    path: str
    where: str  # "host" or "device"
    pinned: bool
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    files: Any  # the caller's fingerprint of the staged tensors as the model holds them (vLLM: fingerprint.
    # files_fingerprint; SGLang: by module group and tensor kind, FingerprintProof.files_hash, or None)
    read_seconds: float
    hash_seconds: float
    mapped: int = 0  # bytes of it copied out of registered maps of the shard files (weights.register_maps)
    prepared: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors made ready for the engine's kernels
    # ahead, by checkpoint name (the caller's `prepare`: vLLM's MXFP4 experts swizzled, vllm/kernels.prepare); the
    # load takes and drops them (`take_prepared`)
    prepare_seconds: float = 0.0
    prepared_bytes: int = 0
    unprepared: str | None = None  # why nothing was prepared where the caller asked (no room on the GPU)

    def read(self, keep: Callable[[str], bool] | None = None):
        """(name, tensor) of the staged tensors whose name `keep` keeps (all without it)."""
        return ((n, t) for n, t in self.tensors if keep is None or keep(n))

    def record(self, ahead: bool) -> dict:
        """What a load report says of it (JSON)."""
        record = {"where": self.where, "pinned": self.pinned, "bytes": self.nbytes, "read_seconds": self.read_seconds,
                  "hash_seconds": self.hash_seconds, "ahead": ahead, "mapped": self.mapped}
        if self.prepared_bytes or self.unprepared:
            record.update(prepared=len(self.prepared), prepared_bytes=self.prepared_bytes,
                          prepare_seconds=self.prepare_seconds, unprepared=self.unprepared)
        return record

    def take_prepared(self) -> dict[str, torch.Tensor]:
        """The prepared tensors, handed to the load once: the staging lets go of them (their memory is freed once the
        load has copied them)."""
        prepared, self.prepared = self.prepared, {}
        return prepared


@dataclass(frozen=True)
class Prepare:
    """What a staging makes of a version for the engine's kernels, beside reading it: `make((name, tensor) pairs)` ->
    the ready tensors by name, `nbytes` of them on the staging's device (checked for room first), `what` they are
    (for the log)."""
    make: Callable[[list[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]
    nbytes: int
    what: str


class Stager:
    """Stages versions into one arena, one at a time (see the module doc); refusals name `names`' fields."""

    def __init__(self, device: torch.device, names: Names = VLLM, share: float = 1.0, maps=None):
        self.device, self.names = device, names
        self.share = share  # of the GPU's free memory a staging there may take (`room`; below 1 for an engine's auto)
        self.maps = maps  # registered maps of the shard files for device stagings (`_fill`), or None
        self.threads: int | None = None  # the reader's threads (`transfer.read_files`); None: its default
        self.arena = Arena(device)
        self._lock = threading.Lock()  # held by the staging that writes the arena
        self._stop = threading.Event()  # the stop signal of the newest staging asked for
        self._said_unprepared = False

    def begin(self) -> threading.Event:
        """A new staging is about to be asked for: the one before it stops. Returns the new one's stop signal."""
        self._stop.set()
        self._stop = threading.Event()
        return self._stop

    def free_device(self) -> int | None:
        """Bytes of the GPU free now, counting the arena held there (None off a GPU)."""
        if self.device.type != "cuda":
            return None
        return device_free(self.device) + self.arena.held("device")

    def stage(self, path: str, where: str, fingerprint: Callable, stop: threading.Event | None = None,
              prepare: Prepare | None = None) -> Staged:
        """Read the version at `path` into the arena (`where`: "host" or "device") and hash it with `fingerprint`
        ((name, tensor) pairs -> the files' fingerprint); then, given `prepare`, make the engine's ready tensors of
        it where they fit (`Prepare`). Raises Cancelled once `stop` is set, StagingRefused where it does not fit."""
        stop = stop if stop is not None else self.begin()
        with self._lock:  # the staging before this one was told to stop: wait for it to let go of the arena
            if stop.is_set():
                raise Cancelled(f"staging {path} was passed over for a newer version")
            t0 = time.perf_counter()
            pieces, nbytes = plan(path)
            free = device_free(self.device) if where == "device" and self.device.type == "cuda" else None
            room(where, max(0, nbytes - self.arena.held(where)), self.device, available_host_bytes(), free, self.names,
                 self.share)
            buf = self.arena.take(where, nbytes)
            on_gpu = buf.is_cuda
            if on_gpu:  # the arena may still be read by copies the server queued (the last load): after them
                torch.cuda.current_stream(self.device).wait_stream(torch.cuda.default_stream(self.device))
            mapped = _fill(buf, pieces, path, stop, self.maps, files_bytes(pieces), self.threads)
            if on_gpu:
                torch.cuda.current_stream(self.device).synchronize()
            tensors = [(p.name, _view(buf, p)) for p in pieces]
            t1 = time.perf_counter()
            files = fingerprint(tensors)
            t2 = time.perf_counter()
            staged = Staged(path, where, self.arena.pinned, tensors, nbytes, files, t1 - t0, t2 - t1, mapped)
            if prepare is not None and not stop.is_set():
                self._prepare(staged, prepare)
            return staged

    def _prepare(self, staged: Staged, prepare: Prepare) -> None:
        """`prepare`'s tensors of `staged`, where the GPU has room for them beside the arena (`gpu_room.fits`);
        else why not, said once a stager."""
        free = device_free(self.device) if self.device.type == "cuda" else None
        if free is not None and not fits(prepare.nbytes, free, self.share):
            staged.unprepared = (f"making {prepare.what} ahead would take {prepare.nbytes / 2**30:.2f} GiB of the "
                                 f"GPU, which has {free / 2**30:.2f} GiB free beside the engine and the staged "
                                 f"version: the load makes them (lower {self.names.memory} to make room)")
            if not self._said_unprepared:
                log.warning("%s", staged.unprepared)
                self._said_unprepared = True
            return
        t0 = time.perf_counter()
        staged.prepared = prepare.make(staged.tensors)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        staged.prepare_seconds = time.perf_counter() - t0
        staged.prepared_bytes = sum(int(t.nbytes) for t in staged.prepared.values())

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self.arena.release()


def _fill(buf: torch.Tensor, pieces: list[Piece], path: str, stop: threading.Event | None = None,
          maps=None, extent: int | None = None, threads: int | None = None) -> int:
    """Read `pieces` of the version at `path` into `buf` at their offsets, shard by shard (offpolicy's parallel reader,
    `transfer.read_files`); raises Cancelled once `stop` is set. `maps` (a `weights.maps.MapCache`, `reader_maps`): a
    shard met before is copied to the GPU straight out of its page-locked map (the learner's publish writes through
    such maps about twice as fast as SGLang's stagings read a version through pinned buffers: docs/weights.md,
    "Registered maps") instead of through the reader's pinned buffers. `extent`: the bytes of the whole
    read `pieces` belong to (the version's, or all its windows'), which the maps keep `versions` times registered:
    bounded by one shard's or one window's bytes instead, a version of several shards would unregister its files
    after every call and register them again at the next (a full page-locking each time, slower than no maps).
    `threads`: the reader's threads (None: its default). Returns the bytes copied out of registered maps."""
    by_shard: dict[str, list[Piece]] = {}
    for p in pieces:
        by_shard.setdefault(p.shard, []).append(p)
    mapped = 0
    for shard, shard_pieces in by_shard.items():
        if stop is not None and stop.is_set():
            raise Cancelled(f"staging {path} was passed over for a newer version")
        fd = os.open(shard, os.O_RDONLY)
        try:
            mapped += read_files([(fd, [(p.file_offset, buf[p.offset:p.offset + p.nbytes])
                                        for p in sorted(shard_pieces, key=lambda p: p.file_offset) if p.nbytes])],
                                 threads, maps=maps, extent=extent)
        finally:
            os.close(fd)
    return mapped


def map_versions(weights) -> int:
    """How many versions' shard files an engine's reads keep registered (`weights.register_maps`: the learner's
    `weights.keep` plus two, as the torch engine's loads), 0 for none; `weights`: the config's weights section."""
    return weights.keep + 2 if weights.register_maps else 0


def reader_maps(versions: int, device: torch.device):
    """This process's registered maps of shard files for reads onto `device` (`weights.maps.shared`, bounded to
    `versions`, `map_versions`), or None off a GPU or for 0."""
    if versions <= 0 or device.type != "cuda":
        return None
    from offpolicy.weights.maps import shared

    return shared(versions)


def _view(buf: torch.Tensor, p: Piece) -> torch.Tensor:
    if p.nbytes == 0:
        return torch.empty(p.shape, dtype=p.dtype, device=buf.device)
    return buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)


def staged_said(record: dict) -> str:
    """How a load took the version (its record's `staged`, `method`), for the engines' log."""
    st = record.get("staged")
    if st is None and record.get("direct"):
        return ", reading the files onto the device a window at a time"
    if st is None and record.get("method") in ("inplace", "disk"):  # why, where a worker said (vLLM: `where_why`)
        return ", reading the files" + (f" ({record['where_why']})" if record.get("where_why") else "")
    if st is None:
        return ""
    where = "page-locked host memory" if st["where"] == "host" and st["pinned"] else f"{st['where']} memory"
    where += " (each tensor to the GPU as the load took it)" if st.get("stream") else ""
    mapped = f" ({st['mapped'] / 1e9:.3f} GB of it out of registered maps)" if st.get("mapped") else ""
    if st.get("prepared_bytes"):
        mapped += f", {st['prepared_bytes'] / 1e9:.3f} GB made ready for the kernels in {st['prepare_seconds']:.3f} s"
    elif st.get("unprepared"):
        mapped += ", nothing made ready for the kernels (no room)"
    return (f", from {st['bytes'] / 1e9:.3f} GB staged in {where} "
            f"{'ahead' if st['ahead'] else 'at the load'} in {st['read_seconds']:.3f} s{mapped}")
