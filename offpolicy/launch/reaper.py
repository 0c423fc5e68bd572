"""The orphan reaper of `offpolicy run`: when the launcher dies, however it dies, no process of the run lives on.

    python -m offpolicy.launch.reaper     (started by the launcher, its stdin a pipe from the launcher)

The launcher starts every daemon and server in a process group of its own and writes `+PGID` here for
each, `-PGID` once that group is gone. The reaper blocks on the pipe; the end of it (the launcher exited:
a SIGKILL, an OOM kill, a closed terminal, or its own clean exit after stopping everything) makes it
SIGTERM every group still listed, SIGKILL what is left `GRACE_S` later, and exit. Each daemon also has
the parent-death signal (offpolicy/plumbing/lifetime.py), but that reaches only the launcher's own children: a
vLLM server's EngineCore and workers are the server's children, in its group, and this is what ends them.
It lives in a session of its own and ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a signal to the
launcher's group is the launcher's to handle); only the pipe's end stops it. Standard library only.
"""

from __future__ import annotations

import signal
import sys

from offpolicy.plumbing.lifetime import kill_groups, live_groups

GRACE_S = 3.0  # SIGTERM to SIGKILL for the groups a dead launcher left: everything is gone within ~3 s


def reap(groups: set[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every group, SIGKILL what is left after grace_s; the groups that had to be SIGKILLed."""
    return sorted(kill_groups(groups, grace_s))


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin.buffer:  # blocks until the launcher writes or exits
        text = line.strip().decode(errors="replace")
        if text[:1] in "+-" and text[1:].isdigit():
            (groups.add if text[0] == "+" else groups.discard)(int(text[1:]))
    left = sorted(live_groups(groups))
    if left:
        killed = reap(set(left))
        print(f"offpolicy reaper: the launcher is gone; stopped process groups {left}"
              f"{f' (SIGKILL: {killed})' if killed else ''}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
