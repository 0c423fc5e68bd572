"""The wire: the contract every process speaks (rollout, hub, learner, relay, eval, subscribers).

Modules: `protocol` (the typed msgspec messages and their array frames; `decode` refuses anything else),
`versions` (per-token weight versions, run-length coded: `rollout.inflight_updates`),
`transport` (ZeroMQ sockets with our options, message batches, uvloop, stop signals), `keys` (CurveZMQ
keys: generation and loading). Nothing is imported here.

May import: config, plumbing (docs/architecture.md, "Dependency rule").
"""
