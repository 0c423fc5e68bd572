"""`offpolicy run`: the one-machine launcher, the same daemons a cluster runs, supervised.

Modules: `run` (`launch`: checks, start, progress, the end-of-run summary), `launcher` (`Launcher`: the
processes of one run, started, followed and stopped), `placement` (which daemons, with which arguments,
GPUs and ports), `supervisor` (deaths noticed, groups killed, restarts within the budget), `reaper` (nothing
outlives the launcher), `stall` (a run that makes no progress says so), `progress` (the live progress line).
The console entry point is `offpolicy.services.cli`; nothing here imports torch.

May import: config, plumbing, models, loggers, rollout.engines.vllm (docs/architecture.md, "Dependency rule").
"""
