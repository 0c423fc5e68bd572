"""Plumbing every part shares: the wire protocol and its sockets, keys, metrics, logs, and the run's
processes, locks and pre-flight checks. Small modules, one concept each, none of them a moving part.

Modules: `protocol` (the typed wire messages), `transport` (ZeroMQ sockets and message batches),
`keys` (CurveZMQ keys), `metrics` (Prometheus registries and scraping), `logs` (log set-up, rate
limits), `runlock` (one live learner per run directory and store), `stores` (weight stores left in
shared memory), `preflight` (checks before a daemon touches anything), `lifetime` (processes die with
their parent), `restarts` (the restart policy of supervised processes), `triton_gate` (where offpolicy's
Triton kernels run).

May import: config (docs/architecture.md, "Dependency rule").
"""
