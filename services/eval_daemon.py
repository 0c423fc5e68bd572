"""`offpolicy-eval`: the eval daemon; FOLLOWS a run's weight versions and evaluates every
`eval.every_versions`-th one into <run dir>/eval.jsonl (offpolicy/eval/daemon.py). Started by
`offpolicy run` and the sbatch script when `eval.every_versions` is set. To evaluate one version now and
exit, `offpolicy eval` (services/eval_version.py)."""

from __future__ import annotations

import sys

from offpolicy.services.args import checked, parser, resolve, setup_runtime


def main(argv: list[str] | None = None) -> int:
    p = parser("offpolicy-eval", "The eval daemon: follow a run and evaluate its weight versions as the learner "
                                 "publishes them (every eval.every_versions), on its own device; never blocks "
                                 "training. To evaluate one version now, use `offpolicy eval`.")
    args = p.parse_intermixed_args(argv)
    cfg = resolve(args)
    if cfg.eval.every_versions < 1:
        print("error: eval.every_versions is 0, so there is nothing for the eval daemon to do: set it, e.g. "
              "eval.every_versions=10 (or use `offpolicy eval` for one version)", file=sys.stderr)
        return 2
    from offpolicy.plumbing import preflight

    checked(preflight.check_model, cfg)
    checked(preflight.check_ports, preflight.metrics_ports(cfg))
    setup_runtime(cfg, "eval")
    from offpolicy.eval.daemon import EvalDaemon
    from offpolicy.plumbing.lifetime import exit_promptly

    exit_promptly(EvalDaemon(cfg).run())  # no module teardown to hold up a stop


if __name__ == "__main__":
    sys.exit(main())
