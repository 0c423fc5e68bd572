"""The token budget of a micro-batch that fills the GPU (`learner.megatron.max_tokens_per_gpu: auto`).

Without recompute, a micro-batch's memory is its activations, saved for the backward, per token and
layer on this rank (bf16, 2 bytes each; h hidden, q = heads x head_dim / tp, kv = query groups x
head_dim / tp, f = FFN width / tp; h / tp under sequence parallelism for the sequence-sharded tensors):
  6 h     layer input, two norms' inputs and outputs, the attention output projection's input
  2 q + 3 kv   the QKV projection's output and RoPE'd q, k (v unrotated)
  3 f     fc1's output (2 f, gate and up: all the fused SwiGLU keeps) and fc2's input
MoE layers: per routed token-copy (top-k of them) the dispatched input and the expert output (2 h),
and f_e-wide expert values: 3 f_e for a SwiGLU (fc1's output and fc2's input), 7.5 f_e for GPT-OSS's
clamped SwiGLU (its clamp, sigmoid and "+1" keep their own tensors; fitted: the GPT-OSS-20B slice saved
36.8 GiB of activations for 68,818 tokens on an H200, 7.4 f_e a copy), plus the router and norms (~4 h).
`activation_bytes` is this sum over the stage's layers, +15% for what it leaves out (measured on an
H100: llama-1b shape, 1.53 MB a token against 1.56 MB estimated; the GPT-OSS slice 0.575 MB against 0.68).
The MoE copy terms were first k x 3 f_e alone, 0.34 MB a token for the slice: its auto budget then ran
an H100 out of memory. Under pipeline parallelism
1F1B keeps up to pp micro-batches in flight on the first stage. `fill` divides the memory left after
the weights, gradients, optimizer state (Adam's two moments are allocated at the first step, so they
are counted ahead), the chunked logprob's blocks and a margin by that, in whole 1024-token steps.
With recompute=full only the layer inputs stay, so the same bound is safe and generous.
"""

from __future__ import annotations

from offpolicy.backends.megatron.arch import Arch

GIB = 1 << 30
CLAMPED_GLU = 7.5  # expert-width values a routed copy keeps under GPT-OSS's clamped SwiGLU (fitted, above)


def activation_bytes(arch: Arch, *, tp: int, pp: int, sequence_parallel: bool, etp: int = 1) -> float:
    """Bytes of saved activations per token of a micro-batch on the first pipeline stage."""
    h_seq = arch.hidden_size / (tp if sequence_parallel else 1)
    q = arch.num_heads * arch.head_dim / tp
    kv = arch.num_query_groups * arch.head_dim / tp
    total = 0.0
    for i in range(arch.num_layers // pp):
        moe = arch.is_moe and arch.moe_layers and arch.moe_layers[i]
        if moe:
            expert = expert_values(arch) * arch.moe_ffn_hidden_size / etp
            mlp = arch.moe_topk * (2 * arch.hidden_size + expert) + 4 * arch.hidden_size
        else:
            mlp = 3 * arch.ffn_hidden_size / tp
        total += 2 * (6 * h_seq + 2 * q + 3 * kv + mlp)
    return 1.15 * total * pp


def expert_values(arch: Arch) -> float:
    """Expert-width values a routed token-copy keeps for the backward: 3 for a SwiGLU (fc1's output and
    fc2's input), CLAMPED_GLU for GPT-OSS's clamped one (memory.py uses the same)."""
    return CLAMPED_GLU if arch.glu_alpha is not None else 3


def fill(arch: Arch, *, free_bytes: float, total_bytes: float, optimizer_bytes: float, chunk_bytes: float,
         tp: int, pp: int, sequence_parallel: bool, etp: int = 1) -> int:
    """The largest 1024-token budget whose activations fit in `free_bytes` minus the optimizer state to
    come, four logprob blocks and a margin of 10% of the GPU (fragmentation, NCCL, compile workspaces)."""
    room = free_bytes - optimizer_bytes - 4 * chunk_bytes - 0.10 * total_bytes
    per_token = activation_bytes(arch, tp=tp, pp=pp, sequence_parallel=sequence_parallel, etp=etp)
    return int(min(max(room / per_token // 1024, 1), 128) * 1024)
