"""`offpolicy-learner`: the learner daemon (rank 0 runs the hub and the weight publisher).

Rank 0 first checks the model and tokenizer paths, takes the run's lock (offpolicy/plumbing/runlock.py: a
second learner of a live run stops here, having changed nothing), checks the checkpoint a `--resume`
needs and its ports; only then does it import torch and touch the run directory or the weight store.
"""

from __future__ import annotations

import sys

from offpolicy.config import ConfigError
from offpolicy.services.args import checked, parser, resolve, setup_runtime


def cpu_megatron(cfg) -> None:
    """megatron-core on a machine without CUDA (learner.device cpu, or auto there): applied before it loads."""
    from offpolicy.learner.backends.megatron.cpu import install_if_cpu

    install_if_cpu(cfg.learner.device)


def main(argv: list[str] | None = None) -> int:
    p = parser("offpolicy-learner", "Train with one-step-off GRPO; serve leases and publish weights.")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in <run.dir>/<run.name> from its newest checkpoint")
    args = p.parse_intermixed_args(argv)
    cfg = resolve(args)
    from offpolicy.plumbing import preflight, runlock

    checked(preflight.check_model, cfg)
    if cfg.learner.backend == "megatron":
        checked(preflight.check_megatron)
        from offpolicy.learner.backends.megatron.parallel import rank_env

        rank = rank_env().rank
        if rank != 0:  # a Megatron worker rank: no hub, it follows rank 0's commands
            cpu_megatron(cfg)
            setup_runtime(cfg, f"learner[r{rank}]")
            from offpolicy.learner.backends import make_backend

            make_backend(cfg).serve()
            return 0
    lock = checked(runlock.acquire, cfg)  # a live run of this name: refused here, before anything changed
    if args.resume:
        checked(preflight.check_resume, cfg)
    checked(preflight.check_ports, preflight.learner_ports(cfg))
    if cfg.learner.backend == "megatron":
        cpu_megatron(cfg)
    setup_runtime(cfg, "learner[r0]")
    from offpolicy.learner.loop import run_learner
    from offpolicy.wire import transport

    from offpolicy.plumbing.lifetime import exit_promptly

    try:
        code = transport.run(lambda: run_learner(cfg, resume=args.resume))
    except ConfigError as e:  # found once the model or data loads (e.g. a checkpoint of another config)
        print(f"error: {e}", file=sys.stderr)
        code = 2
    finally:
        lock.release()
    exit_promptly(code)  # its checkpoint, summary and logs are written: no module teardown to hold up a stop


if __name__ == "__main__":
    sys.exit(main())
