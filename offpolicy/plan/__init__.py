"""`offpolicy plan`: a calibrated simulator and planner for cluster layouts.

Modules, one concept each: `shapes` (parameters, FLOPs, KV bytes of an HF config), `hardware`
(devices, clusters), `memory` (per-GPU memory of learner layouts and rollout servers), `workload`
(batch, lengths, leases), `calibration` (constants with sources, calibration.yaml), `costs` (part
times), `events` and `simulate` (the discrete-event pipeline on the hub's admission rules),
`evaluate` and `search` (candidate layouts), `report` (tables, plot), `validate` (predicted vs
measured), `cli`. Nothing here imports torch (the Megatron package it reads `Arch` from imports
torch for annotations only), so a plan runs in seconds on any machine.
"""
