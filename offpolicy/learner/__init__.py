"""The learner: the loop that trains one weight version behind the rollouts and publishes each version,
with the algorithm's math and the state it keeps.

Modules: `loop` (`train`, `run_learner`: publish, wait for a batch, advantages, step, publish),
`algorithms` (GRPO math as pure functions of tensors), `loss` (`policy_loss`: the GRPO loss of one
micro-batch, composed from `algorithms`; `step_report`), `ledger` (per-step records and the run's
accounting), `checkpoint` (save and resume). Subpackage `backends/`: the backend protocol (its `__init__`),
the embedded `torch` backend and `megatron`; backends import `algorithms` and `loss` only, never the loop.

May import: config, plumbing, wire, data, models, weights, hub, loggers (docs/architecture.md, "Dependency rule").
"""
