"""`offpolicy-learner`: the learner daemon (rank 0 runs the hub and the weight broadcaster)."""

from __future__ import annotations

import sys

from offpolicy.services.args import parser, resolve, setup_runtime


def main(argv: list[str] | None = None) -> int:
    p = parser("offpolicy-learner", "Train with one-step-off GRPO; serve leases and publish weights.")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in <run.dir>/<run.name> from its newest checkpoint")
    args = p.parse_intermixed_args(argv)
    cfg = resolve(args)
    if cfg.learner.backend == "megatron":
        from offpolicy.backends.megatron.parallel import rank_env

        rank = rank_env().rank
        if rank != 0:  # a Megatron worker rank: no hub, it follows rank 0's commands
            setup_runtime(cfg, f"learner[r{rank}]")
            from offpolicy.backends import make_backend

            make_backend(cfg).serve()
            return 0
    setup_runtime(cfg, "learner[r0]")
    from offpolicy import transport
    from offpolicy.learner import run_learner

    return transport.run(lambda: run_learner(cfg, resume=args.resume))


if __name__ == "__main__":
    sys.exit(main())
