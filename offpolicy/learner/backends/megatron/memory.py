"""The learner's memory model: what one GPU of a Megatron layout holds while training (the one model).

Used by the auto token budget (`budget.py`), the docs' per-GPU tables (`seed_table`) and the planner
(`offpolicy/plan/memory.py` reads it for every candidate layout); `tests/unit/test_megatron_memory_peaks.py`
holds it within 15 % of every peak recorded in docs/benchmarks.md, docs/megatron.md and docs/deploy.md.
Pure functions of an `Arch`, a `Layout` and a `Micro` (nothing is built).

`per_gpu(arch, layout, micro)` estimates, for every pipeline stage, what one GPU of that stage holds
while training the way this backend trains (megatron-core DDP with `grad_reduce_in_fp32`, Adam through
the distributed optimizer or not, 1F1B), and returns the largest stage's `Memory`:
- parameters: dense tensors split over TP where Megatron splits them (QKV, output projection, sinks,
  vocabulary rows padded to a multiple of tp), replicated otherwise (norms, row biases, router); experts
  E/ep per GPU, their weights split over etp; stage 0 adds the embedding, the last stage the final norm
  and the output layer. Bytes = parameters x the dtype's size.
- gradients: one main-grad buffer entry per parameter: 4 bytes with `grad_reduce_in_fp32` (the default), the
  model's dtype without it (`Layout.grad_bytes`).
- optimizer: Adam m and v in fp32, plus fp32 master weights when training in bf16/fp16; with the
  distributed optimizer dense state is sharded over the dp ranks and expert state over the
  expert-data-parallel ranks (tp x dp / (ep x etp)). With `optimizer_offload` f (megatron-core's host optimizer
  with its precision-aware optimizer, offload.py) the fraction f of that state lives on the host instead, as
  `HOST_BYTES_PER_PARAM` bytes per parameter (fp32 master, m, v and the gradient's staging copy:
  `Memory.host_bytes`), and the device keeps no fp32 master for it.
- activations: what autograd saves per layer for one micro-batch of `tokens` tokens in sequences of
  `seq_len`, in the dtype (sequence parallel divides the token-sized terms by tp), times the micro-batches
  in flight on the stage under 1F1B (pp - stage, at most the number of micro-batches); the terms are
  listed in `ACTIVATION_TERMS` (`layer_terms` gives them by name), each a tensor that autograd's saved-tensor
  hooks found on GPT-OSS-20B's full-size layers (benchmarks/saved_activations.py; docs/megatron.md, "What a layer
  saves": 134.7 KB a token and layer under flash attention and the grouped experts at EP4, against 177.5 KB
  before the pre-rotary q/k, the residuals and the experts' combined output, which nothing keeps, were
  dropped). Two code paths change them:
  `attention`: "flash" (CoreAttention's flash varlen kernels: CUDA in bf16/fp16, padded or packed; also
  Transformer Engine's fused attention) keeps q, k, v, its output and the log-sum-exp, no score matrix;
  "local" (megatron-core's unfused DotProductAttention and CoreAttention's reference path: CPU, float32)
  keeps k and v repeated to every head and the fp32 softmax and its bf16 copy, heads/tp x s x (s + 1) per
  sequence and layer, sliding layers included (the unfused path masks a full matrix). `experts`: the MoE
  experts module; a routed token-copy keeps its input and `expert_values` x the expert width (3 for a
  SwiGLU: fc1's output and fc2's input, also GPT-OSS's clamped one under the grouped experts' GLU kernel;
  8 for the clamped one under megatron-core's SequentialMLP, whose eager clamp/sigmoid/+1 keep their own
  tensors). `recompute="selective"` keeps no scores (the core attention is recomputed); "full" keeps only
  each layer's input. Expert activations assume balanced routing (k x tokens routed per GPU).
- logits (last stage, `logit_bytes`): the chunked logprob's four float32 blocks of `chunk_bytes`
  (`logits="chunked"`, this backend); `logits="full"` is the earlier loss, which held
  FULL_LOGIT_COPIES float32 [tokens x vocabulary] copies: kept so that the peaks measured with that
  code check the rest of the model.
`budget_bytes_per_token` is the per-token activation bytes of the first stage that the token budget
divides the free memory by. Estimates, not measurements: allocator fragmentation, NCCL buffers and the
CUDA context (a few GiB) are not counted. `GPT_OSS_20B` / `GPT_OSS_120B` are the published config.json
shapes, `gpt_oss_slice` a few of 20B's layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy.learner.backends.megatron.arch import Arch

# the host optimizer's fp32 master weight, Adam m and v and the gradient's fp32 staging copy (16 bytes), and what the
# host's allocators add, as measured (docs/megatron.md, "The optimizer on the host")
HOST_BYTES_PER_PARAM = 18.5

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


ACTIVATION_TERMS = """per layer, what autograd saves for one micro-batch of T tokens (t = T/tp under SP, else T), bytes b of the
dtype, heads and widths split over tp (`layer_terms`; measured on GPT-OSS-20B's layers, docs/megatron.md "What a layer saves"):
attention: input norm's input t*(h*b + 4) (its float32 1/rms), the QKV projection's input (the norm's output)
  t*h*b, RoPE's cos/sin tables of q and k T*4*d*b, the core attention's q/k/v: flash T*(q+2kv)*b (the rotated
  q and k themselves: RoPE's products keep only the tables), local T*3q*b (k and v repeated to every head),
  its output T*q*b (the output projection's input, the same storage), flash's log-sum-exp T*heads*4; local
  adds the scores B*heads*s*(s+1)*(4+b) (the float32 softmax and its bf16 copy); q/k norms (Qwen3) keep q's
  input (a reshaped copy) T*q*b, k's (a view of the QKV output, which it keeps whole) T*(q+2kv)*b and their
  float32 1/rms T*(heads+groups)*4;
MoE: pre-MLP norm's input t*(h*b + 4), the router's input (the norm's output, also what the permutation reads)
  t*h*b, the router's top-k t*k*12 (int64 indices, float32 probabilities; softmax before top-k: + t*E*4);
  per routed token-copy (k*t on a GPU): the experts' input (dispatched, permuted) h*b, c*I*b of expert
  values (expert_values: c = 3 for fc1's output and fc2's input; megatron-core's SequentialMLP under
  GPT-OSS's clamped SwiGLU 8, its eager clamp/sigmoid/+1/probability products keeping their own), and 16 + b
  of routing (the permutation's int64 row indices, the probability; the grouped experts with biases add
  each row's expert, 8, and two one-hot rows of the E/ep local experts, 2*E/ep*b);
dense MLP: norm input t*(h*b + 4), fc1's input t*h*b, fc1 output and fc2 input 3*T*f*b.
Not saved (no term): the residual sums (an add keeps nothing), the pre-rotary q/k, the experts' outputs and
their combined sum (the unpermute keeps its indices only).
last stage: 4 float32 logit blocks of the chunked logprob (learner.megatron.logits_chunk_mib each, at most
  the whole [T x vocab/tp]), or FULL_LOGIT_COPIES whole float32 copies under logits="full"."""


# float32 [tokens x vocabulary/tp] copies the earlier loss held (fitted to a measured Qwen2.5-0.5B peak, docs/megatron.md)
FULL_LOGIT_COPIES = 7.5
# expert-width values a routed copy keeps under GPT-OSS's clamped SwiGLU, per experts module (measured, autograd's
# saved tensors of a full-size layer): SequentialMLP's eager GLU 8 (fc1's output 2, the clamped gate, the clamped
# up, the sigmoid, the gate's product, the up + 1, fc2's input); the grouped experts' Triton (or compiled) GLU
# keeps fc1's output and fc2's input like any SwiGLU (3)
CLAMPED_GLU = {"sequential": 8.0, "grouped": 3.0}
ATTENTION = ("flash", "local")
EXPERTS = tuple(CLAMPED_GLU)
RECOMPUTE = ("none", "selective", "full")
LOGITS = ("chunked", "full")


def expert_values(arch: Arch, experts: str = "grouped") -> float:
    """Expert-width values a routed token-copy keeps for the backward: 3 for a SwiGLU (fc1's output and
    fc2's input), CLAMPED_GLU[experts] for GPT-OSS's clamped one."""
    return CLAMPED_GLU[experts] if arch.glu_alpha is not None else 3


def attention_path(device_type: str, dtype_bytes: int) -> str:
    """The attention path the learner runs: flash on a GPU in bf16/fp16, the unfused local one elsewhere."""
    return "flash" if device_type == "cuda" and dtype_bytes == 2 else "local"


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world: int = 1  # learner GPUs
    distributed_optimizer: bool = True
    sequence_parallel: bool = True  # with tp > 1: token-sized activations split over the TP ranks (MoE needs it)
    optimizer_offload: float = 0.0  # learner.megatron.optimizer_offload: the fraction of the optimizer on the host
    grad_bytes: int = 4  # gradient buffer bytes per parameter: 4 with learner.megatron.grad_reduce_in_fp32, else the dtype's

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
    experts: str = "grouped"  # learner.megatron.experts: "grouped" or "sequential" (megatron's SequentialMLP)
    logits: str = "chunked"  # "chunked" (the chunked logprob) or "full" (the pre-issue-17 loss: FULL_LOGIT_COPIES)

    def __post_init__(self):
        for name, allowed in (("attention", ATTENTION), ("experts", EXPERTS), ("recompute", RECOMPUTE),
                              ("logits", LOGITS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Micro.{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Memory:
    stage: int
    params: int  # parameters held by this GPU (count)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    host_bytes: int = 0  # the optimizer's state on the host (learner.megatron.optimizer_offload), per GPU

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


SNAPSHOT_FORMAT_BYTES = {"fp8": 0.53, "mxfp4": 0.27}  # a low-bit copy's bytes per byte of bf16 (scales included), at most


def publish_snapshot_bytes(param_bytes: float, formats=()) -> float:
    """Device bytes of the weights snapshot an overlapped publish (`weights.overlap_publish`) keeps while
    the next step trains: each rank writes about its own share of the model (learner/backends/megatron/shards.py
    balances a group's tensors by bytes), so about its parameters' bytes in the model's dtype, plus a
    quantized copy per low-bit format (`weights.formats`; what a format leaves unquantized is shared)."""
    return param_bytes * (1.0 + sum(SNAPSHOT_FORMAT_BYTES.get(f, 0.0) for f in formats))


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


def layer_terms(arch: Arch, lay: Layout, micro: Micro) -> dict[str, float]:
    """Bytes autograd saves per layer for one micro-batch, by term (ACTIVATION_TERMS): "attention.*" for
    every layer, "moe.*" for a MoE layer's MLP, "dense.*" for a dense one. "attention.scores" is the local
    path's score matrix (kept without recompute)."""
    h, bb, tp, T = arch.hidden_size, micro.dtype_bytes, lay.tp, micro.tokens
    t = T / (tp if lay.sequence_parallel else 1)  # sequence-sharded tensors
    d, heads = arch.head_dim, arch.num_heads / tp
    q, kv = arch.num_heads * arch.head_dim / tp, arch.num_query_groups * arch.head_dim / tp
    flash = micro.attention == "flash"
    norm = t * (h * bb + 4)  # a norm's input and its float32 1/rms
    out = {"attention.norm_input": norm, "attention.qkv_input": t * h * bb, "attention.rope": T * 4 * d * bb,
           "attention.qkv": T * ((q + 2 * kv) if flash else 3 * q) * bb, "attention.context": T * q * bb,
           "attention.lse": T * heads * 4 if flash else 0.0,
           # q/k norms (qk_norm families): q's input (reshaped: a copy), k's (a view that keeps the whole QKV
           # output), their float32 1/rms
           "attention.qk_norm": T * ((2 * q + 2 * kv) * bb + (heads + arch.num_query_groups / tp) * 4)
           if arch.qk_norm else 0.0,
           "attention.scores": 0.0 if flash else T / micro.seq_len * heads * micro.seq_len * (micro.seq_len + 1)
           * (4 + bb)}
    k, i, e = arch.moe_topk, arch.moe_ffn_hidden_size, arch.num_experts
    routing = 16 + bb  # per copy: the permutation's row indices (int64 x 2) and the probability
    if micro.experts == "grouped" and arch.linear_bias:  # each row's expert, the biases' one-hot rows
        routing += 8 + 2 * e / lay.ep * bb
    out.update({"moe.norm_input": norm, "moe.router_input": t * h * bb,
                "moe.router": t * (k * 12 + (0 if arch.moe_norm_topk else e * 4)),
                "moe.dispatched": k * t * h * bb,
                "moe.expert_values": k * t * expert_values(arch, micro.experts) * i / lay.etp * bb,
                "moe.routing": k * t * routing})
    out.update({"dense.norm_input": norm, "dense.fc1_input": t * h * bb,
                "dense.fc_values": T * 3 * arch.ffn_hidden_size / tp * bb})
    return out


def activations(arch: Arch, lay: Layout, micro: Micro, stage: int) -> int:
    """Bytes of saved activations on one GPU of `stage` at the 1F1B peak (see ACTIVATION_TERMS)."""
    terms = layer_terms(arch, lay, micro)
    h, bb = arch.hidden_size, micro.dtype_bytes
    t = micro.tokens / (lay.tp if lay.sequence_parallel else 1)
    scores = terms["attention.scores"]
    attn = sum(v for n, v in terms.items() if n.startswith("attention.")) - scores
    if micro.recompute == "none":
        attn += scores
    moe = sum(v for n, v in terms.items() if n.startswith("moe."))
    dense = sum(v for n, v in terms.items() if n.startswith("dense."))
    per = arch.num_layers // lay.pp
    layers = range(stage * per, (stage + 1) * per)
    mlps = [moe if arch.moe_layers and arch.moe_layers[j] else dense for j in layers]
    in_flight = min(lay.pp - stage, micro.microbatches)
    if micro.recompute == "full":  # layer inputs, and one layer's activations again while its backward runs
        out = in_flight * per * t * h * bb + attn + max(mlps) + scores
    else:
        out = in_flight * (per * attn + sum(mlps))
        if micro.recompute == "selective":
            out += scores  # one layer's recomputed scores (local path)
    if stage == lay.pp - 1:
        out += logit_bytes(arch, lay, micro)
    return int(out)


def logit_bytes(arch: Arch, lay: Layout, micro: Micro) -> int:
    """The loss's float32 logits on the last stage: four blocks of at most `chunk_bytes` (chunked logprob:
    never [tokens x vocab]), or FULL_LOGIT_COPIES whole copies under `logits="full"`."""
    whole = 4 * arch.padded_vocab(lay.tp) / lay.tp * micro.tokens
    return int(FULL_LOGIT_COPIES * whole if micro.logits == "full" else 4 * min(micro.chunk_bytes, whole))


def budget_bytes_per_token(arch: Arch, lay: Layout, micro: Micro) -> float:
    """Activation bytes per token of a micro-batch on the first stage with every micro-batch 1F1B keeps
    there in flight (min(pp, micro.microbatches)), logits excluded: what the token budget divides by."""
    return (activations(arch, lay, micro, 0) - (logit_bytes(arch, lay, micro) if lay.pp == 1 else 0)) / micro.tokens


def per_gpu(arch: Arch, lay: Layout, micro: Micro) -> Memory:
    """The memory of the busiest pipeline stage's GPU."""
    best = None
    for stage in range(lay.pp):
        dense, expert = stage_params(arch, lay, stage)
        params = dense + expert
        owned = dense / lay.dp + expert / lay.edp if lay.distributed_optimizer else params  # what this GPU updates
        master = 4 if micro.dtype_bytes < 4 else 0
        f = lay.optimizer_offload
        m = Memory(stage, params, params * micro.dtype_bytes, params * lay.grad_bytes,
                   int(owned * (8 + master) * (1 - f)), activations(arch, lay, micro, stage),
                   int(owned * HOST_BYTES_PER_PARAM * f))
        if best is None or m.total_bytes > best.total_bytes:
            best = m
    return best


def table(rows: list[tuple[str, Arch, Layout, Micro]]) -> str:
    """A markdown table of `per_gpu` for each (name, arch, layout, micro-batch), in GiB."""
    gib = 2 ** 30
    out = ["| model | layout (GPUs) | attention, recompute, experts | stage | params/GPU | weights | grads | optimizer | "
           "activations | total GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, arch, lay, micro in rows:
        m = per_gpu(arch, lay, micro)
        out.append(f"| {name} | TP{lay.tp} x EP{lay.ep} x PP{lay.pp}, DP{lay.dp} ({lay.world}) | {micro.attention}, "
                   f"{micro.recompute}, {micro.experts} | {m.stage} | {m.params / 1e9:.2f} B | {m.param_bytes / gib:.1f} | "
                   f"{m.grad_bytes / gib:.1f} | {m.optimizer_bytes / gib:.1f} | {m.activation_bytes / gib:.1f} | "
                   f"{m.total_bytes / gib:.1f} |")
    return "\n".join(out)


def seed_table() -> str:
    """docs/megatron.md's table: GPT-OSS-20B and 120B in the seed's learner layout (TP1 x EP16 x PP4 on 64
    GPUs, DP16, distributed optimizer, bf16), micro-batches of 8192 tokens in sequences of 6144 (2048 prompt
    + 4096 response, configs/gptoss20b-sglang.yaml), 48 micro-batches per step, each attention/recompute with the
    grouped experts (the default), and flash attention with megatron-core's SequentialMLP."""
    from offpolicy.learner.backends.megatron.families import from_hf  # late: the family modules import torch

    lay = Layout(tp=1, ep=16, pp=4, world=64)
    rows = []
    for name, cfg in (("gpt-oss-20b", GPT_OSS_20B), ("gpt-oss-120b", GPT_OSS_120B)):
        arch = from_hf(cfg)
        for attention, recompute, experts in (("local", "none", "grouped"), ("local", "selective", "grouped"),
                                              ("local", "full", "grouped"), ("flash", "none", "grouped"),
                                              ("flash", "none", "sequential")):
            rows.append((name, arch, lay, Micro(tokens=8192, seq_len=6144, microbatches=48, attention=attention,
                                                recompute=recompute, experts=experts)))
    return table(rows)
