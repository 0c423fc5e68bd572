"""How long the processes of a run live: they die with their parent, their groups die with them, and a
stop request ends a daemon within a deadline. Standard library only (the launcher and the reaper import it).

- `die_with_parent(sig)`: a `preexec_fn` for `subprocess.Popen` that asks Linux to send `sig` to the
  child when its parent dies (prctl PR_SET_PDEATHSIG; it survives exec), and exits at once if the parent
  is already gone. Elsewhere it does nothing (the launcher's reaper still covers the child's group).
- `kill_group(pgid, grace_s)`: SIGTERM to a whole process group (a daemon started in its own session with
  every child it made: vLLM's EngineCore and workers), SIGKILL to what is left after `grace_s`; returns
  once the group is empty. A group whose leader is dead and reaped keeps its id while any member lives.
- `exit_deadline(seconds, code, what)`: after a daemon was asked to stop, a timer that ends the process
  with `code` if it is still there `seconds` later (a thread blocked in an HTTP call to a hung server, a
  load that takes minutes: nothing may hold a stopping daemon longer than that), naming `what` it stops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("offpolicy.lifetime")

PR_SET_PDEATHSIG = 1

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl: the reaper alone covers the children
        _prctl = None


def parent_death_supported() -> bool:
    return _prctl is not None


def die_with_parent(sig: int = signal.SIGTERM):
    """A Popen `preexec_fn`: the child gets `sig` when the process that spawned it dies. Everything it calls
    is looked up now, in the parent: between fork and exec the child runs no import and takes no lock."""
    parent, prctl, getppid, exit_now = os.getpid(), _prctl, os.getppid, os._exit

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if getppid() != parent:  # the parent died before the prctl: nobody is left to signal us
            exit_now(1)

    return preexec


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a live member. A zombie (dead, not yet reaped by its new parent) does not
    count: on Linux the members are read from /proc; elsewhere any member does (signal 0 to the group)."""
    if os.path.isdir("/proc/self"):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):  # gone while we looked
                continue
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: it is there
        return True
    return True


def kill_group(pgid: int, grace_s: float = 5.0, poll_s: float = 0.05) -> bool:
    """SIGTERM to group `pgid`, SIGKILL after `grace_s` to what is left; True if it had to SIGKILL.
    Returns when the group is empty (or, past grace_s + 5 s, when only unkillable members are left)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return False
        time.sleep(poll_s)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + 5.0
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return True


def exit_deadline(seconds: float, code: int, what: str) -> threading.Timer:
    """Arm the stop deadline of this daemon: `os._exit(code)` in `seconds` unless the process ended first.
    Logs which threads were still busy (what held the stop) and flushes the logs before it exits."""

    def expire() -> None:
        busy = sorted({t.name for t in threading.enumerate() if t is not threading.current_thread()
                       and not t.daemon and t is not threading.main_thread()})
        log.warning("%s did not finish stopping within %.0f s (busy: %s): exiting now", what, seconds,
                    ", ".join(busy) or "the main thread")
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed stream: nothing left to flush
                pass
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.name, timer.daemon = "exit-deadline", True
    timer.start()
    return timer
