"""Ownership of a run: one live learner holds its run directory and its weight store.

As a database locks its data directory, the learner (rank 0) takes an exclusive `flock` on two lock
files before it changes anything on disk or in shared memory:
- `<run.dir>/.<run.name>.lock`, beside the run directory (so it survives the directory being moved
  aside by a fresh start), and
- `<weights.root>/.<run.name>.lock`, beside the weight store `<weights.root>/<run.name>/`.
The kernel releases a `flock` when its holder dies (SIGKILL included), so a crashed run never leaves a
stale lock; a resumed learner or a fresh one takes it again. Each lock file records its holder (pid,
host, start time) for the messages that refuse a second owner. A relay (`offpolicy-relay` on a rollout
node) owns its node's store the same way, through the store lock alone. Readers (rollouts, the eval
daemon, `offpolicy eval`) take no run lock. `offpolicy run` and `offpolicy stores --free` only `probe`.
Works where `flock` does: local disks, /dev/shm, and NFSv4 (where Linux maps it onto byte-range locks).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from offpolicy.config import Config, ConfigError


class RunBusy(ConfigError):
    """Another live process owns the run (its message names the holder and the fix)."""


def lock_paths(cfg: Config) -> dict[str, Path]:
    """The run's lock files: the run directory's and the weight store's, by the config field that places them."""
    return {"run.dir": Path(cfg.run.dir) / f".{cfg.run.name}.lock",
            "weights.root": Path(cfg.weights.root) / f".{cfg.run.name}.lock"}


def store_lock_path(root: str | os.PathLike, run: str) -> Path:
    return Path(root) / f".{run}.lock"


def holder(path: str | os.PathLike) -> dict | None:
    """Who holds the lock file `path` now ({pid, host, started, ...}), or None when no live process does."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # being written this very moment: the holder is live all the same
        return {"pid": "?", "host": "?"}


def describe(h: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
    return f"pid {h.get('pid')} on {h.get('host')}, {h.get('role', 'learner')} since {started}"


def probe(cfg: Config) -> None:
    """Raise RunBusy when a live learner owns cfg's run directory or weight store (takes nothing)."""
    for field, path in lock_paths(cfg).items():
        h = holder(path)
        if h is not None:
            raise RunBusy(busy_message(cfg, field, path, h))


def busy_message(cfg: Config, field: str, path: Path, h: dict) -> str:
    owner = h.get("role", "learner")
    stop = f"SIGTERM pid {h.get('pid')}" + (", it checkpoints" if owner == "learner" else "")
    return (f"run {cfg.run.name!r} is live: {describe(h)} holds {path} (the lock of {field}); a second "
            f"{owner} on it would destroy it. Stop that one first ({stop}), or pick another run.name "
            f"(e.g. run.name={cfg.run.name}-2)")


class RunLock:
    """The held locks of one run; keep the object alive for as long as the process owns the run."""

    def __init__(self, fds: list[int], paths: list[Path]):
        self.fds, self.paths = fds, paths

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)  # closing the last descriptor drops the flock
        self.fds = []


def acquire(cfg: Config, role: str = "learner", store_only: bool = False) -> RunLock:
    """Take both of the run's locks (non-blocking) or raise RunBusy having taken none. `store_only`: the
    weight store's alone (a relay owns its node's copy of the store, not the run directory)."""
    fds, paths = [], []
    try:
        for field, path in lock_paths(cfg).items():
            if store_only and field != "weights.root":
                continue
            fds.append(_take(cfg, field, path, role))
            paths.append(path)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return RunLock(fds, paths)


def _take(cfg: Config, field: str, path: Path, role: str) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ConfigError(f"config field {field}: cannot create the run's lock file {path} ({e.strerror}); "
                          f"point {field} at a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        h = _read_holder(fd)
        os.close(fd)
        raise RunBusy(busy_message(cfg, field, path, h)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                              "role": role, "run": cfg.run.name}).encode(), 0)
    return fd
