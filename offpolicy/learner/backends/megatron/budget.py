"""The token budget of a micro-batch that fills the GPU (`learner.megatron.max_tokens_per_gpu: auto`).

The bytes a token of a micro-batch costs are the learner's memory model's (`memory.py`, the one model
the docs' tables and the planner use, checked against every recorded peak): the activations autograd
saves per token and layer on this rank for the attention path that runs (flash on a GPU in bf16: no score
matrix) and the experts module (`learner.megatron.experts`), with the pp micro-batches 1F1B keeps in
flight on the first stage, times SAFETY = 1.15 for what the model leaves out (measured per-token
activations: Llama-1B shape 1.53 MB a token against 1.56 MB budgeted; the GPT-OSS slice under
SequentialMLP 0.575 MB against 0.65, under the grouped experts 0.37-0.39 MB against 0.41).
`fill` divides the memory left after the weights, gradients, optimizer state (Adam's two moments are
allocated at the first step, so they are counted ahead), the weights snapshot an overlapped publish keeps
while a step trains (`snapshot_bytes`, memory.publish_snapshot_bytes), the chunked logprob's blocks and a margin of
10 % of the GPU by that, in whole 1024-token steps. The model overestimates rather than under (the
peaks test), so a budget it gives fits. With recompute=full only the layer inputs stay, so the same
bound is safe and generous.
"""

from __future__ import annotations

from offpolicy.learner.backends.megatron import memory
from offpolicy.learner.backends.megatron.arch import Arch

GIB = 1 << 30
SAFETY = 1.15  # margin on the model's per-token activations (fragmentation, what the terms leave out)


def activation_bytes(arch: Arch, *, tp: int, pp: int, sequence_parallel: bool, etp: int = 1,
                     experts: str = "grouped", attention: str = "flash", seq_len: int = 4096) -> float:
    """Bytes of saved activations per token of a micro-batch on the first pipeline stage, pp in flight
    (`memory.budget_bytes_per_token` x SAFETY). `seq_len` matters only on the local attention path."""
    lay = memory.Layout(tp=tp, pp=pp, etp=etp, world=tp * pp, sequence_parallel=sequence_parallel)
    micro = memory.Micro(tokens=seq_len, seq_len=seq_len, microbatches=pp, attention=attention,
                         experts=experts)
    return SAFETY * memory.budget_bytes_per_token(arch, lay, micro)


def fill(arch: Arch, *, free_bytes: float, total_bytes: float, optimizer_bytes: float, chunk_bytes: float,
         tp: int, pp: int, sequence_parallel: bool, etp: int = 1, experts: str = "grouped",
         attention: str = "flash", seq_len: int = 4096, snapshot_bytes: float = 0.0) -> int:
    """The largest 1024-token budget whose activations fit in `free_bytes` minus the optimizer state to
    come, the publish snapshot not held now (`snapshot_bytes`), four logprob blocks and a margin of 10% of
    the GPU (fragmentation, NCCL, compile workspaces)."""
    room = free_bytes - optimizer_bytes - snapshot_bytes - 4 * chunk_bytes - 0.10 * total_bytes
    per_token = activation_bytes(arch, tp=tp, pp=pp, sequence_parallel=sequence_parallel, etp=etp,
                                 experts=experts, attention=attention, seq_len=seq_len)
    return int(min(max(room / per_token // 1024, 1), 128) * 1024)
