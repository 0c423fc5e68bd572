"""Plumbing every part shares: metrics, logs, and the run's processes, locks and pre-flight checks. Small
modules, one concept each, none of them a moving part (the wire the processes speak is `offpolicy.wire`).

Modules: `metrics` (Prometheus registries and scraping), `logs` (log set-up, rate
limits), `runlock` (one live learner per run directory and store), `stores` (weight stores left in
shared memory), `segments` (shared-memory segments a killed process left), `preflight` (checks before a daemon touches anything), `lifetime` (processes die with
their parent), `restarts` (the restart policy of supervised processes), `triton_gate` (where offpolicy's
Triton kernels run), `trace` (each process's spans on the run's timeline, `run.trace`).

May import: config (docs/architecture.md, "Dependency rule").
"""
