"""The hub, the sample queue between rollouts and the learner (on learner rank 0): it leases prompts
to rollouts, takes their sample groups back, checks and admits them, and hands the learner batches.

Modules: `hub` (`Hub`: sockets, rollouts, the learner's side), `lease_desk` (credits in, leases out,
expiry), `intake` (returned groups: check, settle, buffer, Ack), `validation` (`check_group`),
`leases` (the prompt cursor, the lease book, the cursor's checkpoint state), `admission` (staleness
gate, batcher), `batch` (`Group`: the in-memory groups the learner and backends train on).

May import: config, plumbing, wire, data (docs/architecture.md, "Dependency rule").
"""
