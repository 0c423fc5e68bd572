"""A weight version staged for vLLM's in-place reload: its tensors read by offpolicy's reader into memory the worker
keeps, so that the reload takes them as tensors (`reload_weights(weights_iterator=...)`) and reads no file.

Why: vLLM's path reload (`reload_weights(weights_path=...)`) reads the safetensors through its own loader (a map of each
file, pageable host tensors, then a copy per tensor to the GPU) while the server is paused: on the rollout's critical
path. Staged ahead (`worker.Extension.offpolicy_prefetch`, in a thread beside generation, `background.py`), the load's
copies come from the GPU itself ("device") or from page-locked host memory ("host"), and the files' half of the load's
proof is hashed from the staged tensors once they are read (the staged bytes are the files' bytes: the proof still says
that the model holds what the version's files hold).

`rollout.vllm.prefetch` says where (`resolve`): "hash" stages nothing (the old way: only the proof's hash runs ahead);
"host" a buffer of host memory, page-locked with CUDA where the worker has a GPU; "device" a buffer on the worker's GPU
(a full copy of the version beside the server's own weights and KV cache: leave room for it in
`rollout.vllm.gpu_memory_utilization`); "auto" is "device" on a GPU worker when the version and DEVICE_RESERVE fit in
AUTO_DEVICE_SHARE of the GPU's memory free beside the server, else "hash" (and "hash" on a CPU, where the staging would
be one more copy in the same memory, read by the cores that generate). Never "host" by itself: on an H200 (vLLM 0.26,
the 2-layer GPT-OSS slice) a reload from page-locked host tensors took 3.3-3.9 s against 2.3-2.4 s for vLLM's own read
of the files, and the pipeline's loads 4.5-5.2 s against 2.9-3.4 s, while a reload from the GPU took 0.63 s against
3.3 s (docs/benchmarks.md, sixteenth session). Every worker of a server stages the whole version (vLLM's loaders cut
each worker's share out of it).

Invariants:
- One buffer (`Arena`) per worker, reused by every version that fits in it (a model's versions have one size); it grows
  when a version needs more. One staging at a time writes it: a new one first tells the one before it to stop
  (`Stager.begin`) and waits for it (`Stager.stage`).
- Each tensor lies at an offset aligned to ALIGN bytes, as a view of its checkpoint dtype and shape; the tensors are
  listed shard by shard (sorted), by name within a shard (safetensors' own order), as vLLM's reader lists them.
- vLLM's loaders may write into the tensors they are given (GPT-OSS's zeroes `w2_bias` on TP ranks other than 0,
  0.32 `models/gpt_oss.py:1254`): each worker stages a copy of its own, read again for every version, hashed before
  the load, and the replay of what the reload misses (`misses.py`) meets them as the reload left them, which the same
  loaders treat alike. A change that mattered would fail the load's proof.
- Room is checked before any allocation (`room`): a staging that does not fit raises `StagingRefused`, naming
  `rollout.vllm.prefetch` and the fix; the load then reads the files itself (vLLM's path reload).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offpolicy.weights.room import mem_available
from offpolicy.weights.safetensors_view import read_header, torch_dtype
from offpolicy.weights.transfer import read_files

log = logging.getLogger("offpolicy.vllm")

SETTINGS = ("auto", "hash", "host", "device")
ALIGN = 256  # bytes: each staged tensor's offset in the arena (any dtype's, and the GPU's copy alignment)
AUTO_DEVICE_SHARE = 0.5  # auto: the staged copy and DEVICE_RESERVE may take this share of the GPU's free memory
HOST_SHARE = 0.9  # host: the staged copy may take this share of the host's available memory
DEVICE_RESERVE = 1 << 30  # device: GPU bytes that must stay free beside the staged copy


class StagingRefused(RuntimeError):
    """A staging that does not fit where `rollout.vllm.prefetch` puts it (the message names the field and the fix)."""


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
            end += -(-(stop - begin) // ALIGN) * ALIGN
    return pieces, end


def available_host_bytes() -> int:
    """The host's available memory (`weights.room.mem_available`; the physical memory where it is unknown)."""
    available = mem_available()
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve(setting: str, device: torch.device, nbytes: int, free: int | None) -> tuple[str, str]:
    """Where a version of `nbytes` is staged on a worker of `device` (`free`: bytes of its GPU free beside the server,
    counting a staging buffer the worker holds there already) under `rollout.vllm.prefetch` = `setting`: "hash",
    "host" or "device", and why."""
    if setting not in SETTINGS:
        raise ValueError(f"rollout.vllm.prefetch is {setting!r}: use one of {', '.join(SETTINGS)}")
    if setting != "auto":
        return setting, "rollout.vllm.prefetch"
    if device.type != "cuda":
        return "hash", "auto: the server runs on the CPU, where a staged copy would share memory and cores with it"
    gib = nbytes / 2**30
    if free is None or nbytes + DEVICE_RESERVE > AUTO_DEVICE_SHARE * free:
        room_said = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
        return "hash", (f"auto: {gib:.2f} GiB and a {DEVICE_RESERVE / 2**30:.0f} GiB reserve would take more than "
                        f"{AUTO_DEVICE_SHARE:.0%} of the GPU's free memory ({room_said}); rollout.vllm.prefetch=host "
                        "stages in page-locked host memory instead (slower than vLLM's own read of GPT-OSS on an H200)")
    return "device", f"auto: {gib:.2f} GiB on the GPU, where the reload's copies are device to device"


def room(where: str, need: int, device: torch.device, available: int, free: int | None) -> None:
    """Raise StagingRefused when `need` more bytes do not fit `where` ("host": `available` host bytes; "device" on a
    GPU: `free` bytes of it). Nothing more (the arena held already fits the version) always fits: on an H200 the
    server's pool had left 0.42 GiB free, less than DEVICE_RESERVE, and a version that needed no new byte was refused."""
    if need <= 0:
        return
    gib = need / 2**30
    if where == "device" and device.type == "cuda":
        if free is not None and need + DEVICE_RESERVE > free:
            raise StagingRefused(f"rollout.vllm.prefetch=device: staging the version takes {gib:.2f} GiB more of the "
                                 f"GPU ({device}), which has {free / 2**30:.2f} GiB free beside the server; leave room "
                                 "for it (lower rollout.vllm.gpu_memory_utilization) or use rollout.vllm.prefetch=host "
                                 "(page-locked host memory)")
    elif need > HOST_SHARE * available:
        raise StagingRefused(f"rollout.vllm.prefetch={where}: staging the version takes {gib:.2f} GiB more of host "
                             f"memory, which has {available / 2**30:.2f} GiB available; use rollout.vllm.prefetch=hash "
                             "(vLLM reads the files at the load), or give the host more memory")


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
    files: int  # the fingerprint of the staged tensors as the model holds them (fingerprint.files_fingerprint)
    read_seconds: float
    hash_seconds: float

    def read(self, keep: Callable[[str], bool] | None = None):
        """(name, tensor) of the staged tensors whose name `keep` keeps (all without it)."""
        return ((n, t) for n, t in self.tensors if keep is None or keep(n))

    def record(self, ahead: bool) -> dict:
        """What a load report says of it (JSON)."""
        return {"where": self.where, "pinned": self.pinned, "bytes": self.nbytes, "read_seconds": self.read_seconds,
                "hash_seconds": self.hash_seconds, "ahead": ahead}


class Stager:
    """Stages versions into one worker's arena, one at a time (see the module doc)."""

    def __init__(self, device: torch.device, workers: int = 1):
        self.device, self.workers = device, workers
        self.arena = Arena(device)
        self._lock = threading.Lock()  # held by the staging that writes the arena
        self._stop = threading.Event()  # the stop signal of the newest staging asked for

    def begin(self) -> threading.Event:
        """A new staging is about to be asked for: the one before it stops. Returns the new one's stop signal."""
        self._stop.set()
        self._stop = threading.Event()
        return self._stop

    def where(self, path: str, setting: str) -> tuple[str, str]:
        """`resolve` for the version at `path` on this worker."""
        free = None
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0] + self.arena.held("device")
        return resolve(setting, self.device, plan(path)[1], free)

    def stage(self, path: str, where: str, fingerprint: Callable, stop: threading.Event | None = None) -> Staged:
        """Read the version at `path` into the arena (`where`: "host" or "device") and hash it with `fingerprint`
        ((name, tensor) pairs -> the files' fingerprint). Raises Cancelled once `stop` is set, StagingRefused where
        it does not fit."""
        stop = stop if stop is not None else self.begin()
        with self._lock:  # the staging before this one was told to stop: wait for it to let go of the arena
            if stop.is_set():
                raise Cancelled(f"staging {path} was passed over for a newer version")
            t0 = time.perf_counter()
            pieces, nbytes = plan(path)
            free = torch.cuda.mem_get_info(self.device)[0] if where == "device" and self.device.type == "cuda" else None
            room(where, max(0, nbytes - self.arena.held(where)), self.device, available_host_bytes(), free)
            buf = self.arena.take(where, nbytes)
            by_shard: dict[str, list[Piece]] = {}
            for p in pieces:
                by_shard.setdefault(p.shard, []).append(p)
            on_gpu = buf.is_cuda
            if on_gpu:  # the arena may still be read by copies the server queued (the last load): after them
                torch.cuda.current_stream(self.device).wait_stream(torch.cuda.default_stream(self.device))
            for shard, shard_pieces in by_shard.items():
                if stop.is_set():
                    raise Cancelled(f"staging {path} was passed over for a newer version")
                fd = os.open(shard, os.O_RDONLY)
                try:
                    read_files([(fd, [(p.file_offset, buf[p.offset:p.offset + p.nbytes])
                                      for p in sorted(shard_pieces, key=lambda p: p.file_offset) if p.nbytes])])
                finally:
                    os.close(fd)
            if on_gpu:
                torch.cuda.current_stream(self.device).synchronize()
            tensors = [(p.name, _view(buf, p)) for p in pieces]
            t1 = time.perf_counter()
            files = fingerprint(tensors)
            t2 = time.perf_counter()
            return Staged(path, where, self.arena.pinned, tensors, nbytes, files, t1 - t0, t2 - t1)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self.arena.release()


def _view(buf: torch.Tensor, p: Piece) -> torch.Tensor:
    if p.nbytes == 0:
        return torch.empty(p.shape, dtype=p.dtype, device=buf.device)
    return buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)
