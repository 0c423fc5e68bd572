"""How long the processes of a run live: they die with their parent, their groups die with them, and a
stop request ends a daemon within a deadline. Standard library only (the launcher and the reaper import it).

- `die_with_parent(sig)`: a `preexec_fn` for `subprocess.Popen` that asks Linux to send `sig` to the
  child when its parent dies (prctl PR_SET_PDEATHSIG; it survives exec), and exits at once if the parent
  is already gone. Elsewhere it does nothing (the launcher's reaper still covers the child's group).
- `kill_groups(pgids, grace_s)` (`kill_group` for one): SIGTERM to whole process groups at once (a daemon
  started in its own session with every child it made: vLLM's EngineCore and workers), SIGKILL to what is
  left after `grace_s`; returns once the groups are empty. A group whose leader is dead and reaped keeps its
  id while any member lives.
- `exit_deadline(seconds, code, what)`: after a daemon was asked to stop, a timer that ends the process
  with `code` if it is still there `seconds` later (a thread blocked in an HTTP call to a hung server, a
  load that takes minutes: nothing may hold a stopping daemon longer than that), naming `what` it stops.
- `exit_promptly(code)`: a daemon whose work is done (it sent its results, closed its files) ends now: its
  other non-daemon threads are joined, the `atexit` handlers run (trace flushes, trackers), logs and standard streams are flushed, and the process exits
  without the interpreter's teardown of every module, which with torch and transformers loaded takes seconds
  on a busy machine and would hold up a stop.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

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


def live_groups(pgids: set[int]) -> set[int]:
    """Those of process groups `pgids` that have a live member. A zombie (dead, not yet reaped by its new parent)
    does not count: on Linux the members are read from /proc, once for all groups; elsewhere any member does
    (signal 0 to the group)."""
    if not pgids:
        return set()
    if os.path.isdir("/proc/self"):
        live: set[int] = set()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):  # gone while we looked
                continue
            if int(fields[2]) in pgids and fields[0] not in (b"Z", b"X"):
                live.add(int(fields[2]))
        return live
    live = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:  # a member we may not signal: it is there
            pass
        live.add(pgid)
    return live


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a live member (`live_groups`)."""
    return bool(live_groups({pgid}))


def kill_groups(pgids: set[int], grace_s: float = 5.0, poll_s: float = 0.05) -> set[int]:
    """SIGTERM to every group of `pgids` at once, SIGKILL after `grace_s` to what is left of them; the groups
    that had to be SIGKILLed. Returns when they are empty (or, past grace_s + 5 s, when only unkillable members
    are left): stopping n groups takes as long as the slowest, not the sum."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = live_groups(set(pgids))
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = live_groups(alive)
    for pgid in alive:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    left = set(alive)
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = live_groups(left)
    return alive


def kill_group(pgid: int, grace_s: float = 5.0, poll_s: float = 0.05) -> bool:
    """`kill_groups` of one group: True if it had to SIGKILL."""
    return bool(kill_groups({pgid}, grace_s, poll_s))


def _flush_and_exit(code: int) -> NoReturn:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing left to flush
            pass
    os._exit(code)


def exit_promptly(code: int) -> NoReturn:
    """End this daemon with `code` once its own shutdown is done: the atexit handlers run, logs and standard
    streams are flushed, the interpreter's module teardown is skipped (see the module doc). Only for a process's
    last line: anything still buffered in a file object the caller left open is lost."""
    for t in threading.enumerate():  # as the interpreter's own exit does: its threads finish first
        if t is not threading.current_thread() and not t.daemon and t is not threading.main_thread():
            t.join()
    atexit._run_exitfuncs()
    _flush_and_exit(code)


def exit_deadline(seconds: float, code: int, what: str) -> threading.Timer:
    """Arm the stop deadline of this daemon: `os._exit(code)` in `seconds` unless the process ended first.
    Logs which threads were still busy (what held the stop) and flushes the logs before it exits."""

    def expire() -> None:
        busy = sorted({t.name for t in threading.enumerate() if t is not threading.current_thread()
                       and not t.daemon and t is not threading.main_thread()})
        log.warning("%s did not finish stopping within %.0f s (busy: %s): exiting now", what, seconds,
                    ", ".join(busy) or "the main thread")
        _flush_and_exit(code)

    timer = threading.Timer(seconds, expire)
    timer.name, timer.daemon = "exit-deadline", True
    timer.start()
    return timer
