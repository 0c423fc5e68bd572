"""`offpolicy`: the one-machine launcher and small tools.

    offpolicy run CONFIG [overrides] [--dry-run]   learner + rollout daemons on this machine
    offpolicy plot RUN_DIR                         redraw RUN_DIR/reward.png from metrics.jsonl
"""

from __future__ import annotations

import argparse
import sys

from offpolicy.services.args import parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="offpolicy", description="Asynchronous one-step-off RL post-training.")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run a learner and rollout daemons on this machine", add_help=False)
    sub.add_parser("plot", help="draw RUN_DIR/reward.png", add_help=False)
    if not argv or argv[0] not in ("run", "plot"):
        top.parse_args(argv)  # prints usage / help and exits
    command, rest = argv[0], argv[1:]
    if command == "run":
        from offpolicy.services.run import main as run_main

        return run_main(parser("offpolicy run", "Run a learner and run.rollouts rollout daemons on this "
                                                "machine, as real subprocesses on loopback.",
                               config_positional=True).parse_intermixed_args(rest))
    p = argparse.ArgumentParser(prog="offpolicy plot", description="Draw RUN_DIR/reward.png from metrics.jsonl.")
    p.add_argument("run_dir")
    from offpolicy.plot import plot_rewards

    print(plot_rewards(p.parse_args(rest).run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
