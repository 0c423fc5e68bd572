"""Evaluation of weight versions: pass@k, mean reward and response length per prompt and overall.

Two entry points share it (docs/eval.md):
- `offpolicy eval` (services/eval_version.py): evaluates ONE version, now, and exits;
- `offpolicy-eval` (services/eval_daemon.py, the eval daemon): FOLLOWS a run and evaluates every
  `eval.every_versions`-th version as the learner publishes it (`daemon.EvalDaemon`).

Modules: `evaluator` (`Evaluator`: the engine, prompts and reward, built once; evaluates whatever weights
the engine holds), `results` (the resumable per-prompt file and the report), `passk` (the unbiased pass@k
estimator, pure functions), `daemon` (the follower). The `math` reward's answer checking, which training
uses too, is `offpolicy.data.math_answers`. Nothing is imported here, so `offpolicy.eval.passk` stays light.

May import: config, plumbing, wire, data, weights, loggers, rollout.engines (docs/architecture.md, "Dependency rule").
"""
