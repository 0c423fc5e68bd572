"""`offpolicy plan`: a calibrated simulator and planner for cluster layouts.

Modules, one concept each: `shapes` (parameters, FLOPs, KV bytes of an HF config), `hardware`
(devices, clusters), `memory` (per-GPU memory of learner layouts and rollout servers), `workload`
(batch, lengths, leases), `calibration` (constants with sources, calibration.yaml), `costs` (part
times), `events` and `simulate` (the discrete-event pipeline on the hub's admission rules),
`evaluate` and `search` (candidate layouts), `report` (tables, plot), `validate` (predicted vs
measured), `cli`. It needs no GPU: a model's `Arch` comes from the Megatron backend's families (which
import torch, a CPU build is enough), the rest is arithmetic and the simulation. A full search (the
8-node example of docs/deploy.md) takes tens of seconds on 2 cores; given layouts (--layout) take less.

May import: config, hub, learner.backends.megatron, rollout.engines.gpu_room (docs/architecture.md, "Dependency rule").
(`gpu_room`: the engines' rule for a version staged on a GPU, which `versions` prices.)
"""
