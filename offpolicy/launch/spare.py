"""Warm spares: a supervised daemon that died comes back without paying for Python's and torch's imports again.

    python -m offpolicy.launch.spare MODULE     (started by the supervisor, its stdin a pipe from it)

A spare imports what daemon MODULE (offpolicy.services.learner or .rollout) spends its start-up importing (torch,
transformers' model classes, the daemon's own modules: most of a restart on a busy CPU), then blocks on its
stdin. The supervisor (offpolicy/launch/supervisor.py) starts one per kind of process it may have to restart
(`run.supervise.warm_spares`), with that process's environment, in a session of its own, with the parent-death
signal and listed with the reaper, exactly as it starts the daemon itself. A restart hands a spare one JSON line,
`{"args": [...], "log": PATH}`: the spare sends its output to the daemon's log and runs MODULE as `__main__` with
those arguments; it is the daemon from then on (its pid is the restarted process's). The end of the pipe without
a line (the launcher stopped or is gone) ends an unused spare. Nothing of the run is done before the line comes:
the daemon's own checks (its run lock, its ports) run after it, in the same order as in a cold start.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

WARM = {  # what each daemon imports on its way to work, before it reads its config's choices
    "offpolicy.services.learner": ("offpolicy.learner.loop", "offpolicy.learner.backends.torch_backend"),
    "offpolicy.services.rollout": ("offpolicy.rollout.daemon", "offpolicy.rollout.engines.torch_engine"),
}


def warmable(cmd: list[str]) -> bool:
    """Whether a supervised command can run in a spare: `python -m MODULE ...` of a daemon in WARM."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in WARM


def main() -> int:
    module = sys.argv[1]
    for name in WARM[module]:
        importlib.import_module(name)
    import transformers

    transformers.AutoModelForCausalLM  # noqa: B018 (its lazy import: the model classes and generation utils)
    line = sys.stdin.readline()
    if not line:  # not needed: the launcher stopped, or is gone
        return 0
    job = json.loads(line)
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a cold start's stdin: nothing to read
    os.close(devnull)
    sys.argv = [module, *job["args"]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
