"""Warm spares: a supervised daemon that died comes back without paying for Python's and torch's imports again.

    python -m offpolicy.launch.spare NICE     (started by the supervisor, its stdin and stdout pipes to it)

A spare imports what the daemons of WARM (the learner, the rollout daemon) spend their start-up importing (torch,
transformers' model classes, the daemons' own modules: most of a restart on a busy CPU), says `ready` on its stdout,
then blocks on its stdin. The supervisor (offpolicy/launch/supervisor.py) starts one per environment of the processes
it may have to restart (`run.supervise.warm_spares`: on a CPU machine the learner and the rollouts share one, which
takes over whichever restarts first), with that environment, in a session of its own, with the parent-death signal
and listed with the reaper, exactly as it starts a daemon itself. A restart hands a spare one JSON line,
`{"module": MODULE, "args": [...], "log": PATH}`: the spare sends its output to the daemon's log and runs MODULE as
`__main__` with those arguments; it is the daemon from then on (its pid is the restarted process's). The end of
the pipe without a line (the launcher stopped or is gone) ends an unused spare. Nothing of the run is done before
the line comes: the daemon's own checks (its run lock, its ports) run after it, in the same order as in a cold start.

While it warms up a spare runs at niceness NICE (`run.supervise.spare_nice`), so that on a machine of few cores its
imports take only the CPU the run leaves, and the daemon it becomes runs at the launcher's own priority, which an
unprivileged process cannot get back once it raised its niceness. Two mechanisms, as Linux schedules either:
- where the kernel groups tasks by session (CONFIG_SCHED_AUTOGROUP, the default of most distributions, for tasks
  outside a CPU cgroup), every session shares the CPU as one, by its autogroup's niceness, whatever its threads'
  own: the spare, a session of its own, sets that niceness (`/proc/self/autogroup`) to NICE and back to what it
  was when a restart takes it over (any value from 0 up needs no privilege there);
- otherwise threads share the CPU by their own niceness: the imports run in a thread of their own at NICE while
  the main thread, which becomes the daemon, keeps its niceness. numpy is imported first in the main thread:
  OpenBLAS starts its worker threads as it loads, and a thread inherits the niceness of the thread that starts
  it (what else the imports start is housekeeping).
The supervisor hands a restart only to a spare that said `ready` when NICE > 0 (the main thread cannot take over an
import still running in a starved thread): that restart starts cold, and the supervisor replaces the niced spare by
one at niceness 0 (a run that lost a process is likely to lose another; launch/supervisor.py, `keep_spares`).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path

from offpolicy.models.imports import skip_unused

WARM = {  # what each daemon imports on its way to work, before it reads its config's choices
    "offpolicy.services.learner": ("offpolicy.learner.loop", "offpolicy.learner.backends.torch_backend"),
    "offpolicy.services.rollout": ("offpolicy.rollout.daemon", "offpolicy.rollout.engines.torch_engine"),
}  # a spare imports them all: torch's and transformers' imports, most of it, are the same for both


def warmable(cmd: list[str]) -> bool:
    """Whether a supervised command can run in a spare: `python -m MODULE ...` of a daemon in WARM."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in WARM


AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-<id> nice <n>"; absent without CONFIG_SCHED_AUTOGROUP


def group_nice(nice: int | None = None) -> int | None:
    """This session's autogroup niceness, after setting it to `nice` if given; None where there is none, or it cannot
    be set. The kernel takes one write per 0.1 s from an unprivileged process (EAGAIN): retried for up to 2 s."""
    if nice is not None:
        for _ in range(100):
            try:
                AUTOGROUP.write_text(str(nice))
                break
            except BlockingIOError:  # EAGAIN: another write within the last 0.1 s
                time.sleep(0.02)
            except OSError:  # no autogroups here, or not ours to set
                return None
        else:
            return None
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def warm_up(nice: int) -> None:
    """The daemons' imports, in the calling thread at niceness `nice` (the thread's own: the others keep theirs)."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    skip_unused()  # as the daemon's setup_runtime does (services/args.py): nor would it import scikit-learn or scipy
    for name in (m for modules in WARM.values() for m in modules):
        importlib.import_module(name)
    import transformers

    transformers.AutoModelForCausalLM  # noqa: B018 (its lazy import: the model classes and generation utils)


def main() -> int:
    nice = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    ready = os.dup(1)  # the supervisor's pipe: the one line `ready`, then its end
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the imports print goes nowhere, not into the pipe
    os.close(devnull)
    import numpy  # noqa: F401 (in this thread: its BLAS threads keep the daemon's niceness)

    own = group_nice()  # the session's niceness before the warm-up: the daemon's, given back at the hand-over
    if nice and own is not None:
        group_nice(max(own, nice))

    worker = threading.Thread(target=warm_up, args=(nice,), name="spare-warm-up", daemon=True)
    worker.start()
    worker.join()
    try:
        os.write(ready, b"ready\n")
    except BrokenPipeError:  # handed over while it warmed up (spare_nice 0): the supervisor no longer listens
        pass
    os.close(ready)
    line = sys.stdin.readline()
    if not line:  # not needed: the launcher stopped, or is gone
        return 0
    job = json.loads(line)
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    if nice and own is not None and group_nice(own) != own:
        print(f"warm spare: could not set its session's CPU share back to niceness {own} (/proc/self/autogroup); "
              f"the daemon runs at {group_nice()} (run.supervise.spare_nice=0 avoids this)", file=sys.stderr, flush=True)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a cold start's stdin: nothing to read
    os.close(devnull)
    sys.argv = [job["module"], *job["args"]]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
