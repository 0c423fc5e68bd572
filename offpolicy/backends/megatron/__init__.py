"""The megatron-core learner backend (`learner.backend: megatron`); see docs/megatron.md.

Modules: `arch` (HF config -> model description and TransformerConfig), `mapping` (HF <-> Megatron
parameter layout, TP sharding), `parallel` (ranks and process groups), `model` (build, load,
gather), `logprobs` (vocab-parallel log-softmax), `batching` (token-budget micro-batches),
`backend` (the LearnerBackend), `verify` (the `offpolicy verify` precision check). Nothing here
imports megatron at package import time.
"""
