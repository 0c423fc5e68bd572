"""`offpolicy-rollout`: one rollout daemon (one engine) that generates for the learner's hub."""

from __future__ import annotations

import os
import sys

from offpolicy.services.args import checked, parser, resolve, setup_runtime


def main(argv: list[str] | None = None) -> int:
    p = parser("offpolicy-rollout", "Generate and score sample groups for the learner at transport.learner_host "
                                    "(env OFFPOLICY_LEARNER_HOST overrides it).")
    p.add_argument("--index", type=int, default=None,
                   help="this daemon's index (seeds, metrics); default: env OFFPOLICY_ROLLOUT_INDEX, "
                        "SLURM_PROCID, or 0")
    args = p.parse_intermixed_args(argv)
    cfg = resolve(args)
    index = args.index
    if index is None:
        index = int(os.environ.get("OFFPOLICY_ROLLOUT_INDEX") or os.environ.get("SLURM_PROCID") or 0)
    from offpolicy.config import ConfigError
    from offpolicy.plumbing import preflight
    from offpolicy.relay.topology import local_announce

    checked(preflight.check_model, cfg)
    checked(preflight.check_ports, preflight.metrics_ports(cfg))

    try:  # rollout.announce: relay needs this node's relay address; a wrong setting fails here, naming it
        if cfg.rollout.announce == "relay":
            local_announce(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_runtime(cfg, f"rollout[{index}]")
    from offpolicy.plumbing.lifetime import exit_promptly
    from offpolicy.rollout.daemon import RolloutDaemon
    from offpolicy.wire import transport

    daemon = RolloutDaemon(cfg, index)
    code = transport.run(daemon.run)
    daemon.close()  # the engine, once the loop and its threads are done
    exit_promptly(code)  # no module teardown to hold up a stop


if __name__ == "__main__":
    sys.exit(main())
