"""The rollout side: a daemon that leases prompts from the hub, generates with an engine, scores and
sends the groups back, and swaps to each new weight version between batches.

Modules: `daemon` (`RolloutDaemon`: the session with the hub, credits, lifecycle), `swap`
(`VersionFollower`, `WeightSwapper`: follow announced versions, load them into the engine), `generation`
(`LeaseGenerator`: generate, score, send). The data path: rollout -> hub (samples) -> learner ->
weights -> rollout (versions).

May import: config, plumbing, data, weights, relay, engines (docs/architecture.md, "Dependency rule").
"""
