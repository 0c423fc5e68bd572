"""Memory per GPU of a learner layout (Megatron) and of a rollout server (SGLang or the torch engine).

Learner, per GPU of the worst pipeline stage, as our Megatron backend allocates it
(offpolicy/backends/megatron/backend.py: bf16 parameters, `grad_reduce_in_fp32=True` main grads,
Adam with fp32 master weights and two moments, sharded over data-parallel ranks by the distributed
optimizer; experts over the expert-data-parallel ranks):
- params 2 B, grads 4 B, optimizer 12 B / dp per parameter held;
- activations saved for backward per token and layer, from the tensors the local spec keeps (written
  out in `layer_activation_bytes`), times the micro-batches a 1F1B first stage holds (min(pp, m));
- logits: `logit_copies` float32 copies of the vocabulary slice per token on the last stage (the GRPO
  loss materialises log-softmax and its grad; the count is fitted to the measured 108.3 GiB peak of
  docs/benchmarks.md "Megatron learner, one GPU" and then checked against every other recorded peak).
Rollout server (SGLang): weights per GPU (experts at the published precision) + the KV pool SGLang
sizes from `mem_fraction_static`.
Pure arithmetic in bytes; `Memory.total` is what is compared with the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        return f"TP{self.tp} x EP{self.ep} x PP{self.pp} x DP{self.dp}" + (f" ETP{self.etp}" if self.etp > 1 else "")


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.kv_cache

    def gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / GIB, 2) for k in
                ("params", "grads", "optimizer", "activations", "logits", "kv_cache", "total")}


def layer_activation_bytes(shape: Shape, seq: float, tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Bytes one token leaves saved for backward in one decoder layer (bf16 tensors, local spec):
    attention: norm and QKV inputs (4h), Q and the K, V expanded to all heads plus the output
    projection's input (8 x heads x head_dim), the softmax probabilities of the unfused attention
    (2 x heads x span), qk-norm inputs; MLP: norm and fc1 inputs (4h), gate/up output, SwiGLU product
    and fc2 input (8f); a MoE layer keeps top-k copies of the routed tokens (6kh) and 8f per copy.
    Without sequence parallelism TP splits all but the 8h of norm and layer inputs; with it, all."""
    a = shape.arch
    h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_query_groups * a.head_dim
    if recompute == "full":
        return 2 * h / (tp if sp else 1)
    probs = 2 * a.num_heads * shape.attention_span(seq)
    attn_split = 8 * q + probs + (2 * (q + kv) if a.qk_norm else 0)
    if recompute == "selective":
        attn_split -= probs + 4 * q  # core attention recomputed
    if a.is_moe:
        k, f = a.moe_topk, a.moe_ffn_hidden_size
        moe_frac = shape.moe_layers / a.num_layers
        mlp_split = moe_frac * (6 * k * h + 8 * k * f) + (1 - moe_frac) * 8 * a.ffn_hidden_size
    else:
        mlp_split = 8 * a.ffn_hidden_size
    unsplit = 8 * h
    return (unsplit + attn_split + mlp_split) / tp if sp else unsplit + (attn_split + mlp_split) / tp


def micro_tokens(lay: LearnerLayout, tokens_per_rank: float, seq: float) -> float:
    """Tokens of one micro-batch: the budget, but never less than one row of `seq` tokens (a longer
    row gets a micro-batch of its own) nor more than the rank's share of the step."""
    return min(max(lay.max_tokens_per_gpu, seq), max(1.0, tokens_per_rank))


def learner_memory(shape: Shape, lay: LearnerLayout, seq: float, tokens_per_rank: int, logit_copies: float) -> Memory:
    """Peak bytes on the busiest GPU: the first pipeline stage (it holds min(pp, m) micro-batches
    of activations) or the last (the logits), whichever is larger. `tokens_per_rank` is the step's
    tokens one data-parallel rank trains (it sets the number of micro-batches m)."""
    a = shape.arch
    per_layer_dense = (shape.dense_params - shape.embedding_params) / a.num_layers
    per_layer_expert = shape.expert_params / a.num_layers
    layers = a.num_layers // lay.pp
    emb_local = a.vocab_size * a.hidden_size / lay.tp  # one vocabulary-parallel embedding table
    dense = layers * per_layer_dense / lay.tp
    experts = layers * per_layer_expert / (lay.ep * lay.etp)
    opt_dense = 12 / (lay.dp if lay.distributed_optimizer else 1)
    opt_expert = 12 / (lay.expert_dp if lay.distributed_optimizer else 1)
    tokens = micro_tokens(lay, tokens_per_rank, seq)
    micro = max(1, math.ceil(tokens_per_rank / tokens))
    act_layer = tokens * layer_activation_bytes(shape, seq, lay.tp, lay.sequence_parallel, lay.recompute)
    stages = []
    for first, last in ((True, lay.pp == 1), (False, True)) if lay.pp > 1 else ((True, True),):
        n_emb = (1 if first else 0) + (1 if last and (not a.tie_embeddings or lay.pp > 1) else 0)
        p_dense = dense + n_emb * emb_local
        held = min(lay.pp, micro) if first else 1
        stages.append(Memory(params=2 * (p_dense + experts), grads=4 * (p_dense + experts),
                             optimizer=opt_dense * p_dense + opt_expert * experts,
                             activations=held * layers * act_layer,
                             logits=logit_copies * 4 * a.padded_vocab(lay.tp) / lay.tp * tokens if last else 0.0))
    return max(stages, key=lambda m: m.total)


@dataclass(frozen=True)
class RolloutServerSpec:
    engine: str = "sglang"  # the cluster engine (the torch engine is planned only in validate.py)
    tp: int = 1  # GPUs of the server (SGLang tp_size; experts split over ep_size within them)
    ep: int = 1
    expert_bits: float = 16.0  # precision of the expert weights the server runs (16 = the bf16 the learner publishes)
    mem_fraction: float = 0.8  # SGLang mem_fraction_static: weights + KV pool
    max_running: int = 512  # SGLang max_running_requests

    def label(self) -> str:
        bits = "" if self.expert_bits == 16 else f" experts {self.expert_bits:g} bit"
        return f"{self.engine} TP{self.tp}" + (f" EP{self.ep}" if self.ep > 1 else "") + bits


def rollout_memory(shape: Shape, srv: RolloutServerSpec, budget: float) -> Memory:
    """Per GPU of an SGLang server: weights, and the KV pool, which is what `budget` (the bytes it may
    take: mem_fraction_static x the GPU, less a colocated learner's share) leaves after the weights."""
    weights = shape.weight_bytes(srv.expert_bits) / srv.tp
    return Memory(params=weights, grads=0.0, optimizer=0.0, activations=0.0, kv_cache=max(0.0, budget - weights))
