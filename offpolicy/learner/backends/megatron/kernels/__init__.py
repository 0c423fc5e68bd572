"""The Megatron learner's compute pieces for megatron-core's local (non-Transformer-Engine) layer spec.

Modules: `attention` (flash attention over padded or packed micro-batches), `norms` and `norm_kernels`
(RMSNorm under sequence parallelism; its Triton kernels), `experts` and `expert_linear` (grouped-GEMM experts,
GPT-OSS's biased experts), `permutation` and `rows` (MoE token permutation by gathers), `moe_triton` and
`moe_kernels` (the MoE layer's memory-bound passes in Triton), `logprobs` and `logprob_kernels` (per-token
logprobs and entropy in vocabulary chunks; their Triton kernels), `glu` (the dense MLP's SwiGLU module), `qkv` and `qkv_kernels` (the
self-attention's q/k/v split, head norms and RoPE fused; their Triton kernels), `rope` (RoPE's cos/sin tables),
`compiled` (torch.compile'd elementwise kernels, GPU only). Nothing is imported here.
"""
