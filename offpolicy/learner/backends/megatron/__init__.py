"""The megatron-core learner backend (`learner.backend: megatron`); see docs/megatron.md.

Modules: `backend` (the LearnerBackend), `arch` (HF config -> model description and TransformerConfig),
`mapping` (HF <-> Megatron parameter layout, TP and EP sharding), `parallel` (ranks and process groups),
`model` (build, load, gather), `source` (the HF tensors the loader reads), `shards` (this rank's share of a
weight version), `batching` (token-budget micro-batches), `budget` and `memory` (the token budget and the
memory model), `adam`, `clip` and `grad_accum` (the optimizer step's pieces), `offload` (the optimizer on the host),
`heap` (the host heap given back and frozen), `cpu` (megatron-core on a CPU
with gloo), `verify` (the `offpolicy verify` precision check). Subpackages: `families/` (one module per model
family and the registry), `kernels/` (attention, norms, experts, permutation, logprobs), `checkpointing/`
(the distributed and per-rank formats). Nothing here imports megatron at package import time.
"""
