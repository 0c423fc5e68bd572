"""The wire: the contract every process speaks (rollout, hub, learner, relay, eval, subscribers).

Modules: `protocol` (the typed msgspec messages and their array frames; `decode` refuses anything else),
`transport` (ZeroMQ sockets with our options, message batches, uvloop, stop signals), `keys` (CurveZMQ
keys: generation and loading). Nothing is imported here.

May import: config, plumbing (docs/architecture.md, "Dependency rule").
"""
