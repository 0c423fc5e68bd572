"""The rollout side: a daemon that leases prompts from the hub, generates with an engine, scores and
sends the groups back, and swaps to each new weight version between batches.

Modules: `daemon` (`RolloutDaemon`: the session with the hub, credits, lifecycle), `swap`
(`VersionFollower`, `WeightSwapper`: follow announced versions, load them into the engine), `generation`
(`LeaseGenerator`: generate, score, send). Subpackage `engines/`: the engine protocol (its `__init__`),
the embedded `torch` engine, `vllm` and `sglang` (their servers in process or over HTTP). The data path: rollout -> hub (samples) -> learner ->
weights -> rollout (versions).

May import: config, plumbing, wire, data, models, weights, relay (docs/architecture.md, "Dependency rule").
"""
