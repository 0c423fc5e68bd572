"""The run's record: the run directory and the experiment trackers.

Modules: `runlog` (`RunLog`: the run directory, metrics.jsonl, trained.jsonl, summary.json), `trackers`
(`open_trackers`: every metrics.jsonl scalar to the configured trackers, off the learner's thread), one module
per tracker (`console`, `wandb_run`, `tensorboard_run`, `mlflow_run`) and its `state`, `plot` (reward.png,
eval.png), `timeline` (the run's timeline: trace.json for Perfetto, timeline.png). Nothing is imported here, so each module stays as light as its own imports.

May import: config, plumbing, hub (docs/architecture.md, "Dependency rule").
"""
