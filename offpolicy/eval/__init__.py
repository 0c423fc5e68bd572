"""Evaluation of weight versions: pass@k, mean reward and response length per prompt and overall.

Two entry points share it (docs/eval.md):
- `offpolicy eval` (services/eval_version.py): evaluates ONE version, now, and exits;
- `offpolicy-eval` (services/eval_daemon.py, the eval daemon): FOLLOWS a run and evaluates every
  `eval.every_versions`-th version as the learner publishes it (`daemon.EvalDaemon`).

Modules: `evaluator` (`Evaluator`: the engine, prompts and reward, built once; evaluates whatever weights
the engine holds), `results` (the resumable per-prompt file and the report), `passk` (the unbiased pass@k
estimator, pure functions), `daemon` (the follower), `math_answers` (final-answer extraction and
equivalence, the `math` reward's, which training uses too). Nothing is imported here, so
`offpolicy.eval.passk` or `offpolicy.eval.math_answers` stays light.
"""
