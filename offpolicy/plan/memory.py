"""Memory per GPU of a learner layout (Megatron) and of a rollout server (SGLang or the torch engine).

Learner: the learner's one memory model, `offpolicy/learner/backends/megatron/memory.py` (also the auto token
budget's and the docs' tables; held within 15 % of every recorded peak by
tests/unit/test_megatron_memory_peaks.py), for the code path the learner runs on a GPU: flash attention
(no score matrix), the layout's experts (grouped by default), the chunked logprob. `learner_memory` maps a LearnerLayout
and the step's tokens per data-parallel rank onto it (micro-batch tokens, micro-batches in flight) and
splits the busiest stage's bytes into the planner's parts; nothing here counts bytes of its own.
With the optimizer on the host (`LearnerLayout.optimizer_offload`) `Memory.host` is
its state per GPU (`HOST_BYTES_PER_PARAM`, 18.5 bytes per parameter the GPU updates), which `evaluate.check` holds with the weight versions
kept in /dev/shm against the node's host memory (`Cluster.host_gib`).
Rollout server (SGLang, vLLM; the torch engine with its double buffer's second copy): weights per GPU (experts at
the published precision) + the KV pool the server sizes from its memory fraction (`mem_fraction_static`).
Pure arithmetic in bytes; `Memory.total` is what is compared with the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offpolicy.learner.backends.megatron import memory as model
from offpolicy.learner.backends.megatron import microbatches
from offpolicy.plan.shapes import Shape

GIB = 2**30


@dataclass(frozen=True)
class LearnerLayout:
    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    max_tokens_per_gpu: int = 16384  # learner.megatron.max_tokens_per_gpu (rows x padded length per micro-batch)
    recompute: str = "none"  # none, selective, full
    distributed_optimizer: bool = True
    optimizer_offload: float = 0.0  # learner.megatron.optimizer_offload (1.0: the optimizer on the host)
    grad_fp32: bool = True  # learner.megatron.grad_reduce_in_fp32 (false: bf16 gradient buffers)
    experts: str = "grouped"  # learner.megatron.experts: grouped (default) or sequential (megatron-core SequentialMLP)
    pp_microbatches: int | str = "auto"  # learner.megatron.pp_microbatches (pp > 1: the fewest micro-batches a rank)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.ep * self.etp * self.pp)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def check(self, shape: Shape) -> str | None:
        """Why this layout cannot run `shape` (None if it can)."""
        a = shape.arch
        if self.gpus % (self.tp * self.pp) or self.gpus % (self.ep * self.etp * self.pp):
            return f"{self.gpus} GPUs are not a multiple of tp x pp = {self.tp * self.pp} and ep x etp x pp"
        if a.num_heads % self.tp or a.num_query_groups % self.tp:
            return f"tp {self.tp} does not divide {a.num_heads} heads / {a.num_query_groups} KV heads"
        if a.num_layers % self.pp:
            return f"pp {self.pp} does not divide {a.num_layers} layers"
        if not a.is_moe and (self.ep > 1 or self.etp > 1):
            return "ep/etp > 1 on a dense model"
        if a.is_moe and (a.num_experts % self.ep or a.moe_ffn_hidden_size % self.etp):
            return f"ep {self.ep} / etp {self.etp} do not divide {a.num_experts} experts / the expert FFN"
        return None

    def label(self) -> str:
        return (f"TP{self.tp} x EP{self.ep} x PP{self.pp} x DP{self.dp}" + (f" ETP{self.etp}" if self.etp > 1 else "")
                + (" + host optimizer" if self.optimizer_offload else ""))


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float = 0.0
    kv_cache: float = 0.0
    host: float = 0.0  # the optimizer's state on the host for this GPU (learner.megatron.optimizer_offload); not in total

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.kv_cache

    def gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / GIB, 2) for k in
                ("params", "grads", "optimizer", "activations", "logits", "kv_cache", "total", "host")}


def micro_tokens(lay: LearnerLayout, tokens_per_rank: float, seq: float) -> float:
    """Tokens of one micro-batch: the budget, but never less than one row of `seq` tokens (a longer
    row gets a micro-batch of its own) nor more than the rank's share of the step; with pp > 1 lowered as the
    learner lowers it (`microbatches.budget`: at least `lay.pp_microbatches` micro-batches, auto 4 a stage)."""
    tokens = min(max(lay.max_tokens_per_gpu, seq), max(1.0, tokens_per_rank))
    return float(microbatches.budget(tokens_per_rank, tokens, microbatches.minimum(lay.pp_microbatches, lay.pp), seq))


def learner_memory(shape: Shape, lay: LearnerLayout, seq: float, tokens_per_rank: int) -> Memory:
    """Peak bytes on the busiest GPU (`megatron.memory.per_gpu`): micro-batches of `micro_tokens` tokens in
    sequences of `seq`, as many as `tokens_per_rank` (the step's tokens one data-parallel rank trains) needs."""
    tokens = micro_tokens(lay, tokens_per_rank, seq)
    m_lay = model.Layout(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp, world=lay.gpus,
                         distributed_optimizer=lay.distributed_optimizer, sequence_parallel=lay.sequence_parallel,
                         optimizer_offload=lay.optimizer_offload, grad_bytes=4 if lay.grad_fp32 else 2)
    micro = model.Micro(tokens=int(tokens), seq_len=int(seq), microbatches=max(1, math.ceil(tokens_per_rank / tokens)),
                        attention="flash", recompute=lay.recompute, experts=lay.experts, logits="chunked")
    m = model.per_gpu(shape.arch, m_lay, micro)
    logits = model.logit_bytes(shape.arch, m_lay, micro) if m.stage == lay.pp - 1 else 0
    return Memory(params=m.param_bytes, grads=m.grad_bytes, optimizer=m.optimizer_bytes,
                  activations=m.activation_bytes - logits, logits=logits, host=m.host_bytes)


@dataclass(frozen=True)
class RolloutServerSpec:
    engine: str = "sglang"  # rollout.engine: sglang, vllm or torch (one decode model for all: costs.decode_step_s)
    tp: int = 1  # GPUs of the server (SGLang tp_size; experts split over ep_size within them)
    ep: int = 1
    expert_bits: float = 16.0  # precision of the expert weights the server runs (16 = the bf16 the learner publishes)
    mem_fraction: float = 0.8  # SGLang mem_fraction_static: weights + KV pool
    max_running: int = 512  # SGLang max_running_requests
    load: str = "auto"  # vLLM: rollout.vllm.load_method (auto: in place, MXFP4 versions too, each worker its part)
    stage: str = "auto"  # where a version is staged ahead: vLLM rollout.vllm.prefetch, SGLang rollout.sglang.prefetch

    def label(self) -> str:
        bits = "" if self.expert_bits == 16 else f" experts {self.expert_bits:g} bit"
        how = f" ({self.load})" if self.engine == "vllm" and self.load != "auto" else ""
        staged = f" (stage {self.stage})" if self.engine != "torch" and self.stage != "auto" else ""
        return f"{self.engine} TP{self.tp}" + (f" EP{self.ep}" if self.ep > 1 else "") + bits + how + staged


def rollout_memory(shape: Shape, srv: RolloutServerSpec, budget: float) -> Memory:
    """Per GPU of a server: weights, and the KV pool, which is what `budget` (the bytes it may take:
    mem_fraction_static x the GPU, less a colocated learner's share) leaves after the weights. The torch engine
    holds a second copy of the weights (rollout.double_buffer: the next version is read into it), in bf16 whatever
    the versions' format (it dequantizes them)."""
    if srv.engine == "torch":  # it dequantizes low-bit versions to bf16 on load, and keeps the spare copy
        weights = 2 * shape.weight_bytes(16.0) / srv.tp
    else:
        weights = shape.weight_bytes(srv.expert_bits) / srv.tp
    return Memory(params=weights, grads=0.0, optimizer=0.0, activations=0.0, kv_cache=max(0.0, budget - weights))
