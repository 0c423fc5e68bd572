"""`offpolicy run`: the one-machine launcher, the same daemons a cluster runs, supervised.

Modules: `run` (`launch`: checks, start, progress, the end-of-run summary), `launcher` (`Launcher`: the
processes of one run, started, followed and stopped), `placement` (which daemons, with which arguments,
GPUs and ports), `supervisor` (deaths noticed, groups killed, restarts within the budget), `reaper` (nothing
outlives the launcher), `spare` (a warm spare process a restart takes over), `stall` (a run that makes no
progress says so), `progress` (the live progress line). The console entry point is `offpolicy.services.cli`;
nothing the launcher runs imports torch (a spare, a process of its own, imports the daemons' modules by name).

May import: config, plumbing, models, loggers, rollout.engines.launch, rollout.engines.vllm,
rollout.engines.sglang (docs/architecture.md, "Dependency rule").
"""
