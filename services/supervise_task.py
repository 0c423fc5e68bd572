"""One supervised process in a Slurm task: the restart policy of `offpolicy run` for a rollout node's daemons.

    python -m offpolicy.services.supervise_task --config C [overrides] --name NAME [--always] -- CMD [ARGS ...]

deploy/slurm/task.sh runs each rollout daemon and each vLLM server through this (Slurm restarts nothing
inside a job, docs/operations.md). It starts CMD in a process group of its own with the parent-death
signal; when CMD exits unexpectedly (a non-zero exit or a signal; with --always, as a vLLM server, any
exit) its whole group goes (a server's EngineCore and workers), and CMD starts again after the backoff of
run.supervise, within its budget (offpolicy/plumbing/restarts.py), each on one stderr line naming what died, how,
and what is done. A rollout daemon that exits 0 left on the learner's Goodbye: the task ends with 0. Past
the budget the task ends with CMD's exit status (128 + N for a signal), as before. SIGTERM or SIGINT
(scancel, the job's end) goes to CMD's group and ends the task once CMD is gone, without a restart.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from offpolicy.config import ConfigError, load_config
from offpolicy.plumbing.lifetime import die_with_parent, kill_group
from offpolicy.plumbing.restarts import RestartPolicy


def say(name: str, text: str) -> None:
    node = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    print(f"supervise_task: {time.strftime('%H:%M:%S')} {name} on {node}: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("supervise_task: error: give the command after --, e.g. ... --name rollout-0 -- offpolicy-rollout ...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    own, cmd = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="supervise_task", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML run config (its run.supervise section is the policy)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--name", required=True, help="what the command is, in messages (e.g. rollout-3, vllm-3)")
    p.add_argument("--always", action="store_true", help="restart on any exit, 0 too (a server never leaves on "
                                                         "its own)")
    args = p.parse_intermixed_args(own)
    if not cmd:
        p.error("the command after -- is empty")
    try:
        cfg = load_config(args.config, args.overrides).run.supervise
    except ConfigError as e:
        print(f"supervise_task: error: {e}", file=sys.stderr)
        return 2
    policy, stop = RestartPolicy(cfg), threading.Event()
    child: list[subprocess.Popen] = []

    def on_signal(signum, _frame) -> None:
        stop.set()
        if child and child[0].poll() is None:
            os.killpg(child[0].pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    restarts = 0
    while True:
        started = time.monotonic()
        child[:] = [subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))]
        if stop.is_set():  # the signal came while it started
            os.killpg(child[0].pid, signal.SIGTERM)
        code = child[0].wait()
        kill_group(child[0].pid, cfg.kill_grace_s)  # what it left in its group goes before anything else
        status = code if code >= 0 else 128 - code
        if stop.is_set():
            return status
        if code == 0 and not args.always:
            return 0
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        what = f"{args.name} (pid {child[0].pid}) {how} after {time.monotonic() - started:.0f} s"
        decision = policy.decide(args.name, time.monotonic())
        if not decision.allowed:
            say(args.name, f"{what}; {decision.reason}: not restarted")
            return status or 1
        say(args.name, f"{what}; restarting it in {decision.delay_s:.0f} s (restart {decision.count} of "
                       f"run.supervise.max_restarts={cfg.max_restarts})")
        if stop.wait(decision.delay_s):
            return status
        restarts += 1
        say(args.name, f"restarted (restart {restarts} of this task)")


if __name__ == "__main__":
    sys.exit(main())
