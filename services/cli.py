"""`offpolicy`: the one-machine launcher and small tools.

    offpolicy run CONFIG [overrides] [--dry-run]   learner + rollout daemons on this machine
    offpolicy plot RUN_DIR [RUN_DIR ...] [--out F] redraw RUN_DIR/reward.png, or overlay several runs in F
    offpolicy keys DIR [--client NAME ...]         CurveZMQ keys: server pair, client pairs, allowlist
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offpolicy.services.args import parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="offpolicy", description="Asynchronous one-step-off RL post-training.")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run a learner and rollout daemons on this machine", add_help=False)
    sub.add_parser("plot", help="draw reward curves of one or more runs", add_help=False)
    sub.add_parser("keys", help="generate CurveZMQ keys for transport.curve", add_help=False)
    if not argv or argv[0] not in ("run", "plot", "keys"):
        top.parse_args(argv)  # prints usage / help and exits
    command, rest = argv[0], argv[1:]
    if command == "run":
        from offpolicy.services.run import main as run_main

        p = parser("offpolicy run", "Run a learner and run.rollouts rollout daemons on this machine, as real "
                                    "subprocesses on loopback.", config_positional=True)
        p.add_argument("--resume", action="store_true", help="continue the run directory's newest checkpoint")
        return run_main(p.parse_intermixed_args(rest))
    if command == "keys":
        return keys_main(rest)
    p = argparse.ArgumentParser(prog="offpolicy plot", description="Draw reward curves (per step and per wall "
                                "second) from metrics.jsonl: RUN_DIR/reward.png for one run, or several runs "
                                "overlaid in --out.")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", help="output PNG (required for more than one run)")
    args = p.parse_args(rest)
    from offpolicy.plot import plot_rewards, plot_runs

    if len(args.run_dirs) > 1 and not args.out:
        p.error("give --out FILE.png to overlay several runs")
    print(plot_runs(args.run_dirs, args.out) if args.out else plot_rewards(args.run_dirs[0]))
    return 0

def keys_main(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy keys", description="Create a CurveZMQ keys directory: the "
                                "learner's key pair, one key pair per client, and the allowlist of client keys.")
    p.add_argument("dir", help="keys directory (transport.keys_dir)")
    p.add_argument("--client", action="append", default=[],
                   help="client key pair to add (repeatable); default: one named 'rollout'")
    args = p.parse_args(rest)
    from offpolicy.keys import generate

    names = args.client or ([] if (Path(args.dir) / "rollout.key_secret").exists() else ["rollout"])
    root = generate(args.dir, names)
    print(f"{root}: server.key (public, for clients), server.key_secret (learner only), "
          f"clients/ (allowlist), client key pairs: {', '.join(n + '.key_secret' for n in names) or 'none new'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
