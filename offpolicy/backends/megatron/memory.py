"""Per-GPU memory of a Megatron learner layout: parameters, gradients, optimizer state, activations.

`per_gpu(arch, layout, micro)` estimates, for every pipeline stage, what one GPU of that stage holds
while training the way this backend trains (megatron-core DDP with `grad_reduce_in_fp32`, Adam through
the distributed optimizer or not, 1F1B), and returns the largest stage's `Memory`. Counted from the
`Arch` (nothing is built):
- parameters: dense tensors split over TP where Megatron splits them (QKV, output projection, sinks,
  vocabulary rows padded to a multiple of tp), replicated otherwise (norms, row biases, router); experts
  E/ep per GPU, their weights split over etp; stage 0 adds the embedding, the last stage the final norm
  and the output layer. Bytes = parameters x the dtype's size.
- gradients: one fp32 main-grad buffer entry per parameter (4 bytes; `grad_reduce_in_fp32`).
- optimizer: Adam m and v in fp32, plus fp32 master weights when training in bf16/fp16; with the
  distributed optimizer dense state is sharded over the dp ranks and expert state over the
  expert-data-parallel ranks (tp x dp / (ep x etp)).
- activations: what autograd saves per layer for one micro-batch of `tokens` tokens in sequences of
  `seq_len`, in the dtype (sequence parallel divides the token-sized terms by tp), times the micro-batches
  in flight on the stage under 1F1B (pp - stage, at most the number of micro-batches), plus the last
  stage's chunked-logprob blocks (4 x `chunk_bytes`: the logits are never held whole). Dense MLP layers
  keep fc1's output and fc2's input (3 f); MoE layers per routed copy 2 h plus `budget.expert_values`
  x f_e (3 for a SwiGLU, 7.5 for GPT-OSS's clamped one, fitted on an H200), the same terms the auto token
  budget (`budget.py`) uses. The attention term depends on
  `attention`: "local" (megatron-core's DotProductAttention, this backend's spec: fp32 softmax output and
  its bf16 copy per score, b x heads/tp x s x (s + 1) per layer, sliding layers included: the local
  path masks a full score matrix) or "flash" (no score matrix). `recompute="selective"` keeps no scores
  (the core attention is recomputed); "full" keeps only each layer's input. Expert activations assume
  balanced routing (k x tokens routed per GPU). The terms are listed in `ACTIVATION_TERMS` of the module.
Estimates, not measurements: allocator fragmentation, NCCL buffers and the CUDA context (a few GiB)
are not counted. `GPT_OSS_20B` / `GPT_OSS_120B` are the published config.json shapes, `gpt_oss_slice`
a few of 20B's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy.backends.megatron.arch import Arch
from offpolicy.backends.megatron.budget import expert_values

_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096, rope_theta=150000.0)
GPT_OSS_20B = dict(model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
                   num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, rope_parameters=_YARN)
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}


def gpt_oss_slice(layers: int = 2) -> dict:
    """GPT-OSS-20B's shapes (hidden 2880, 64/8 heads of 64, 32 experts top-4 of FFN 2880, vocabulary 201088)
    with `layers` layers, sliding and full alternating: what one GPU benchmarks (benchmarks/megatron_learner.py)."""
    return {**GPT_OSS_20B, "num_hidden_layers": layers}

ACTIVATION_TERMS = """per layer, T tokens of the micro-batch on this GPU (T/tp under SP), bytes b of the dtype:
attention: input norm input T*h*b, QKV input T*h*b, q/k/v T*(q+2kv)*b and the rotated q/k T*(q+k)*b,
  scores (local) B*heads/tp*s*(s+1)*(4+b), context T*q/tp*b, output-projection residual T*h*b;
MoE: pre-MLP norm input and router input 2*T*h*b, router logits T*E*4, per routed token-copy (k*T per GPU):
  dispatched input h*b, combined output h*b, and c*I*b of expert values (c = 3: fc1 output 2I, fc2 input I;
  c = 7.5 under GPT-OSS's clamped SwiGLU, whose clamp/sigmoid/+1 keep their own: fitted on an H200);
  residual T*h*b;
dense MLP: norm input and residual 2*T*h*b, fc1 output and fc2 input 3*T*f/tp*b;
last stage: 4 float32 logit blocks of the chunked logprob (learner.megatron.logits_chunk_mib each)."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world: int = 1  # learner GPUs
    distributed_optimizer: bool = True

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: the TP x DP ranks of a stage, regrouped as etp x ep x edp."""
        return self.tp * self.dp // (self.ep * self.etp)


@dataclass(frozen=True)
class Micro:
    tokens: int  # tokens of one micro-batch (learner.megatron.max_tokens_per_gpu)
    seq_len: int  # tokens per sequence (prompt + response)
    microbatches: int = 8  # micro-batches per step on each DP rank (bounds those in flight)
    dtype_bytes: int = 2  # bf16
    attention: str = "local"  # "local" (materialised scores) or "flash"
    recompute: str = "none"  # "none", "selective" or "full"
    chunk_bytes: int = 1 << 30  # learner.megatron.logits_chunk_mib: the chunked logprob's float32 block


@dataclass(frozen=True)
class Memory:
    stage: int
    params: int  # parameters held by this GPU (count)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def stage_params(arch: Arch, lay: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters one GPU of pipeline stage `stage` holds."""
    h, d, tp = arch.hidden_size, arch.head_dim, lay.tp
    q, kv, b = arch.num_heads * d, arch.num_query_groups * d, int(arch.linear_bias)
    attn = (h * (q + 2 * kv) + q * h + (q + 2 * kv) * int(arch.qkv_bias)) // tp + b * h + 2 * h
    attn += arch.num_heads // tp if arch.attn_sinks else 0
    attn += 2 * d if arch.qk_norm else 0
    i = arch.moe_ffn_hidden_size
    expert = (3 * h * i + b * 2 * i) // lay.etp + b * h
    per = arch.num_layers // lay.pp
    layers = range(stage * per, (stage + 1) * per)
    moe = sum(1 for j in layers if arch.moe_layers and arch.moe_layers[j])
    dense_mlp = (per - moe) * (3 * h * arch.ffn_hidden_size // tp)
    dense = per * attn + moe * arch.num_experts * (h + b) + dense_mlp
    vocab = arch.padded_vocab(tp) // tp * h
    if stage == 0:
        dense += vocab
    if stage == lay.pp - 1:
        dense += h + (0 if arch.tie_embeddings and lay.pp == 1 else vocab)
    return dense, moe * arch.num_experts // lay.ep * expert


def activations(arch: Arch, lay: Layout, micro: Micro, stage: int) -> int:
    """Bytes of saved activations on one GPU of `stage` at the 1F1B peak (see ACTIVATION_TERMS)."""
    h, bb, tp = arch.hidden_size, micro.dtype_bytes, lay.tp
    t = micro.tokens / tp  # sequence parallel (MoE training with tp > 1 needs it)
    q, kv = arch.num_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    seqs = micro.tokens / micro.seq_len
    scores = seqs * arch.num_heads / tp * micro.seq_len * (micro.seq_len + 1) * (4 + bb)
    attn = t * h * bb * 3 + micro.tokens * ((q + 2 * kv) + (q + kv)) / tp * bb + micro.tokens * q / tp * bb
    if micro.attention == "local" and micro.recompute == "none":
        attn += scores
    k, i = arch.moe_topk, arch.moe_ffn_hidden_size
    # per routed copy: dispatched input and expert output (2 h) and the expert's values (budget.expert_values)
    moe = 2 * t * h * bb + t * arch.num_experts * 4 + k * t * (2 * h + expert_values(arch) * i) * bb + t * h * bb
    dense = 2 * t * h * bb + micro.tokens * 3 * arch.ffn_hidden_size / tp * bb  # norm input, fc1 out, fc2 in
    per = arch.num_layers // lay.pp
    layers = range(stage * per, (stage + 1) * per)
    mlps = [moe if arch.moe_layers and arch.moe_layers[j] else dense for j in layers]
    in_flight = min(lay.pp - stage, micro.microbatches)
    if micro.recompute == "full":  # layer inputs, and one layer's activations again while its backward runs
        out = in_flight * per * t * h * bb + attn + max(mlps) + (scores if micro.attention == "local" else 0)
    else:
        out = in_flight * (per * attn + sum(mlps))
        if micro.recompute == "selective" and micro.attention == "local":
            out += scores  # one layer's recomputed scores
    if stage == lay.pp - 1:
        out += 4 * micro.chunk_bytes  # the chunked logprob's float32 logit blocks (never [tokens x vocab])
    return int(out)


def per_gpu(arch: Arch, lay: Layout, micro: Micro) -> Memory:
    """The memory of the busiest pipeline stage's GPU."""
    best = None
    for stage in range(lay.pp):
        dense, expert = stage_params(arch, lay, stage)
        params = dense + expert
        master = 4 if micro.dtype_bytes < 4 else 0
        state = 8 + master
        if lay.distributed_optimizer:
            opt = dense * state / lay.dp + expert * state / lay.edp
        else:
            opt = params * state
        m = Memory(stage, params, params * micro.dtype_bytes, params * 4, int(opt),
                   activations(arch, lay, micro, stage))
        if best is None or m.total_bytes > best.total_bytes:
            best = m
    return best


def table(rows: list[tuple[str, Arch, Layout, Micro]]) -> str:
    """A markdown table of `per_gpu` for each (name, arch, layout, micro-batch), in GiB."""
    gib = 2 ** 30
    out = ["| model | layout (GPUs) | attention, recompute | stage | params/GPU | weights | grads | optimizer | "
           "activations | total GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, arch, lay, micro in rows:
        m = per_gpu(arch, lay, micro)
        out.append(f"| {name} | TP{lay.tp} x EP{lay.ep} x PP{lay.pp}, DP{lay.dp} ({lay.world}) | {micro.attention}, "
                   f"{micro.recompute} | {m.stage} | {m.params / 1e9:.2f} B | {m.param_bytes / gib:.1f} | "
                   f"{m.grad_bytes / gib:.1f} | {m.optimizer_bytes / gib:.1f} | {m.activation_bytes / gib:.1f} | "
                   f"{m.total_bytes / gib:.1f} |")
    return "\n".join(out)


def seed_table() -> str:
    """docs/megatron.md's table: GPT-OSS-20B and 120B in the seed's learner layout (TP1 x EP16 x PP4 on 64
    GPUs, DP16, distributed optimizer, bf16), micro-batches of 8192 tokens in sequences of 6144 (2048 prompt
    + 4096 response, configs/gptoss20b-sglang.yaml), 48 micro-batches per step, each attention/recompute."""
    from offpolicy.backends.megatron.families import from_hf  # late: the family modules import torch

    lay = Layout(tp=1, ep=16, pp=4, world=64)
    rows = []
    for name, cfg in (("gpt-oss-20b", GPT_OSS_20B), ("gpt-oss-120b", GPT_OSS_120B)):
        arch = from_hf(cfg)
        for attention, recompute in (("local", "none"), ("local", "selective"), ("local", "full"), ("flash", "none")):
            rows.append((name, arch, lay, Micro(tokens=8192, seq_len=6144, microbatches=48, attention=attention,
                                                recompute=recompute)))
    return table(rows)
