"""Whether the host has room for the weight versions a run keeps in shared memory.

Each format's store keeps its newest `weights.keep` versions (older ones stay while a rollout still reads them) and
writes the next one beside them; under /dev/shm (a tmpfs) all of that is host memory. On a learner node whose memory
also holds the host optimizer (`learner.megatron.optimizer_offload`), it can exceed what is left, and the kernel's
out-of-memory killer then ends the learner minutes into the run with SIGKILL and no word of why: GPT-OSS-20B, 360 GiB
of Adam state beside 41.8 GB bf16 versions on a 503 GiB node, died at step 5. `shortfall_message`, called right
after version 0 is published (its size known, the optimizer allocated), says so at start-up, with the fixes.
Linux only (/proc); elsewhere it says nothing. Imports nothing heavy.
"""

from __future__ import annotations

import os
from pathlib import Path

from offpolicy.weights.formats import NATIVE, store_run
from offpolicy.weights.store import version_dir

MARGIN = 0.05  # of the versions' bytes, for what else grows (page cache is not counted: MemAvailable frees it)


def mem_available(meminfo: str | os.PathLike = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), bytes; None where unknown."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def on_tmpfs(path: str | os.PathLike, mounts: str | os.PathLike = "/proc/mounts") -> bool:
    """Whether `path` lies on a tmpfs (memory-backed) file system: the longest mount point above it decides."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype == "tmpfs"


def version_bytes(root: str, run: str, version: int, formats: list[str]) -> int:
    """Bytes of `version` over the native store and every format's (the files in each version directory)."""
    total = 0
    for fmt in (NATIVE, *formats):
        d = version_dir(root, store_run(run, fmt), version)
        if d.is_dir():
            total += sum(e.stat().st_size for e in os.scandir(d) if e.is_file())
    return total


def shortfall(one_version: int, keep: int, available: int) -> int:
    """Bytes missing for `keep` more versions of `one_version` bytes each (the newest `keep` kept and the next one
    written beside them, one of those already there) beyond `available`, with MARGIN; 0 when they fit."""
    need = int(keep * one_version * (1 + MARGIN))
    return max(0, need - available)


def shortfall_message(root: str, run: str, version: int, formats: list[str], keep: int,
                      available: int | None = None, mounts: str | os.PathLike = "/proc/mounts") -> str | None:
    """A warning when the store under `root` (on a tmpfs) will outgrow the host's available memory; else None."""
    if not on_tmpfs(root, mounts):
        return None
    available = mem_available() if available is None else available
    one = version_bytes(root, run, version, formats)
    if available is None or one == 0:
        return None
    short = shortfall(one, keep, available)
    if not short:
        return None
    gb = 1e9
    return (f"host memory: weights.keep={keep} more versions of {one / gb:.1f} GB (every format: "
            f"{', '.join([NATIVE, *formats])}) will be kept in {root}, host memory, where {available / gb:.1f} GB "
            f"are available now (more stay while a rollout still reads an older one): the kernel's out-of-memory "
            f"killer will likely end a process of this run (often the learner, SIGKILL) {short / gb:.1f} GB short. "
            f"Make room: the optimizer on the GPUs (learner.megatron.optimizer_offload=0) where they hold it, "
            f"weights.native=checkpoints where every rollout reads a low-bit format (the native versions then only at "
            f"checkpoints), weights.keep=2 (the least) if higher, no weights.formats a rollout does not read, or a "
            f"node with more memory")
