"""Weight stores left in shared memory: list them, free them, never a live run's.

A run's store is `<weights.root>/<run>/` (native versions, plus `<fmt>/` folders of low-bit formats);
for GPT-OSS-20B that is tens of GB of RAM in /dev/shm. Retention (docs/operations.md):
- `offpolicy run` frees its run's store when it exits (finished, failed or stopped), unless
  `weights.keep_after_run` is set; checkpoints keep their own copy (`checkpoints/step-N/hf/`), and a
  resume publishes again from its checkpoint, so nothing a run needs later lives only in the store;
- `offpolicy stores [--root R]` lists the stores with their size, versions and owner;
  `offpolicy stores --free NAME ...` (or `--free-all`) frees stores nobody owns.
A store is live while a process holds its lock (`<root>/.<run>.lock`, offpolicy/plumbing/runlock.py): freeing
takes that lock exclusively first, so a live run's store is refused and no learner can take it while it
is being removed. Imports nothing heavy.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path

import msgspec

from offpolicy.plumbing.runlock import describe, holder, store_lock_path

_VERSION = re.compile(r"^v(\d+)$")


class StoreInfo(msgspec.Struct):
    name: str
    path: str
    bytes: int
    versions: list[int]  # native versions
    formats: list[str]  # low-bit format folders
    owner: dict | None  # the live holder of its lock, or None


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:  # collected while we walked
                pass
    return total


def list_stores(root: str | os.PathLike) -> list[StoreInfo]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        versions = sorted(int(m.group(1)) for e in entry.iterdir() if (m := _VERSION.match(e.name)))
        formats = sorted(e.name for e in entry.iterdir() if e.is_dir() and not e.name.startswith(".")
                         and not _VERSION.match(e.name))
        out.append(StoreInfo(entry.name, str(entry), _size(entry), versions, formats,
                             holder(store_lock_path(root, entry.name))))
    return out


class StoreLive(Exception):
    """The store belongs to a live process."""


def free(root: str | os.PathLike, name: str) -> int:
    """Remove store `name` of `root` unless a live process owns it (StoreLive); returns the bytes freed."""
    path = Path(root) / name
    if name.startswith(".") or "/" in name or not path.is_dir():
        raise FileNotFoundError(f"no weight store {name!r} in {root}")
    lock = store_lock_path(root, name)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            h = holder(lock)
            raise StoreLive(f"weight store {path} is live: {describe(h) if h else 'a process'} owns it; "
                            "stop that run first") from None
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        os.unlink(lock)  # unlinked while held: a learner starting now locks a fresh file, on no store
        return size
    finally:
        os.close(fd)


def table(stores: list[StoreInfo]) -> str:
    if not stores:
        return "no weight stores"
    rows = [("store", "size", "versions", "formats", "owner")]
    for s in stores:
        v = f"v{s.versions[0]}..v{s.versions[-1]} ({len(s.versions)})" if s.versions else "-"
        rows.append((s.name, f"{s.bytes / 2**20:,.1f} MiB", v, ",".join(s.formats) or "-",
                     f"live: {describe(s.owner)}" if s.owner else "none (can be freed)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
