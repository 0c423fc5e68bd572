"""Per-part cost models: a lease's generation, a learner step, a relay hop (a weight version's publish and load:
versions.py; the gathered publish of the runs before the sharded publish: `gathered_publish`).

Every constant comes from the calibration (calibration.yaml, each with its source); the shapes of
the formulas are stated here:
- decode step (SGLang): a per-layer floor (batch-1 latency, a public figure) plus the longer of the
  memory time (weights of the experts some row routes to + the KV of every running sequence, over
  the HBM bandwidth at an assumed efficiency) and the compute time (2 x active params x rows over the
  bf16 peak at an efficiency fitted to a public figure); TP adds two all-reduces per layer;
- a lease (SGLang) is continuous batching: all rows start after one prefill per prompt (the n
  samples share it), run in lockstep, and leave as they finish; at most `max_running` (and what the
  KV pool holds) run at once. Its time is the sum over the steps up to the longest response: the
  long tail of the length distribution is paid with a shrinking batch (the torch engine's static
  batch, for the validation runs, runs to its longest row at the measured per-step time: validate.py);
- learner step: model FLOPs over (MFU x peak x GPUs), the MFU measured on our Megatron learner at
  the tokens one GPU computes per micro-batch (the micro-batch over tp under sequence parallelism;
  interpolated in log2 tokens between the measured sizes) and at the model's width (interpolated in
  log2 hidden between the two measured widths: `mfu`), plus the 1F1B bubble, for MoE under
  megatron-core's SequentialMLP (`learner.megatron.experts=sequential`) a measured cost per (micro-batch,
  MoE layer) and per local expert (the grouped experts, the default, have no such term: their cost is in
  the wide MFU, measured with them), the TP/EP/DP collectives over NVLink or the node's network share
  (added in full: the backend overlaps the DP gradient reduce with the last micro-batch's backward,
  `learner.megatron.overlap_grad_reduce`, which the planner does not credit), and the optimizer on the host
  (`host_optimizer_s`: Adam at the node's per-core rate x its cores);
- the gathered publish (what every Megatron learner ran before the sharded publish, and what the
  recorded runs validate.py rebuilds ran): gather to rank 0 at the measured rate plus a latency per expert
  tensor on another rank, then the weight store's write (a line fitted to the weights benchmark, per path);
- relay: one hop moves a version at min(network, one ZeroMQ stream, sha256 on one thread when
  checksums are on); a chain is pipelined by relay.window chunks, so node k waits one hop plus
  (k - 1) windows.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from offpolicy.plan.calibration import Calibration
from offpolicy.plan.hardware import Cluster, Device
from offpolicy.plan.memory import LearnerLayout, RolloutServerSpec, micro_tokens
from offpolicy.plan.shapes import Shape

ALLREDUCE_LATENCY_S = 10e-6  # one small NCCL collective inside a node (assumed, not measured here)
RELAY_WINDOW_BYTES = 8 * 4 * 1024**2  # relay.window x relay.chunk_bytes (config defaults)
MEASURED_MICRO_TOKENS = (4096, 8192, 16384)
# hidden sizes of the two measured MFU curves: Qwen2.5-0.5B (learner.mfu_<tokens>), GPT-OSS-20B (learner.mfu_wide_8192)
NARROW_HIDDEN, WIDE_HIDDEN = 896, 2880


def decode_step_s(shape: Shape, srv: RolloutServerSpec, dev: Device, cal: Calibration, rows: int,
                  context: float) -> float:
    """One SGLang decode step of `rows` running sequences of mean `context` tokens."""
    a = shape.arch
    touched = 1 - (1 - a.moe_topk / a.num_experts) ** rows if a.is_moe else 1.0
    weights = (2 * shape.dense_params + shape.expert_params * srv.expert_bits / 8 * touched) / srv.tp
    kv = rows * shape.kv_bytes(context) / srv.tp
    flops = rows * (2 * shape.active_params + 4 * a.num_layers * a.num_heads * a.head_dim
                    * shape.attention_span(context)) / srv.tp
    roof = max((weights + kv) / (dev.hbm_gbps * 1e9 * cal.get("sglang.hbm_efficiency")),
               flops / (dev.peak_tflops * 1e12 * cal.get("sglang.decode_efficiency")))
    comm = 0.0
    if srv.tp > 1:
        per = rows * a.hidden_size * 2 * 2 * (srv.tp - 1) / srv.tp / (dev.nvlink_gbps * 1e9)
        comm = 2 * a.num_layers * (per + ALLREDUCE_LATENCY_S)
    return a.num_layers * cal.get("sglang.step_floor_per_layer_s") + roof + comm


def prefill_s(shape: Shape, srv: RolloutServerSpec, dev: Device, cal: Calibration, tokens: float) -> float:
    return 2 * shape.active_params * tokens / srv.tp / (dev.peak_tflops * 1e12 * cal.get("sglang.prefill_efficiency"))


def sglang_lease_s(shape: Shape, srv: RolloutServerSpec, dev: Device, cal: Calibration, lengths: np.ndarray,
                   prompt: int, groups: int, pool_bytes: float) -> float:
    """Continuous batching of one lease: prefill, then lockstep decode with rows leaving as they finish.
    At most max_running rows run at once, and no more than the KV pool (`pool_bytes` per GPU) holds
    at the lease's mean context."""
    fit = int(pool_bytes * srv.tp / shape.kv_bytes(prompt + float(lengths.mean())))
    cap = max(1, min(srv.max_running, fit))
    t = prefill_s(shape, srv, dev, cal, groups * prompt)
    pending = list(map(int, lengths[cap:]))[::-1]
    heap = [(int(x), 0) for x in lengths[:cap]]  # (finish step, start step) of each running row
    heapq.heapify(heap)
    step, start_sum = 0, 0  # sum of the running rows' start steps (a row's context: prompt + step - start)
    while heap:
        n, k = len(heap), heap[0][0] - step
        if k > 0:
            t += k * decode_step_s(shape, srv, dev, cal, n, prompt + step + k / 2 - start_sum / n)
            step += k
        while heap and heap[0][0] == step:
            start_sum -= heapq.heappop(heap)[1]
            if pending:  # a queued row takes the freed place (its prompt is cached)
                heapq.heappush(heap, (step + pending.pop(), step))
                start_sum += step
    return t


def _narrow_mfu(cal: Calibration, tokens: float) -> float:
    """The Qwen2.5-0.5B curve (hidden 896): interpolated in log2(tokens) between the measured sizes."""
    pts = [(math.log2(t), cal.get(f"learner.mfu_{t}")) for t in MEASURED_MICRO_TOKENS]
    x = math.log2(max(1.0, tokens))
    if x >= pts[-1][0]:
        return pts[-1][1]
    if x <= pts[0][0]:
        return pts[0][1] * 2 ** (x - pts[0][0])  # halving the micro-batch below the smallest halves it
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def mfu(cal: Calibration, tokens: float, hidden: int = NARROW_HIDDEN) -> float:
    """Measured MFU at `tokens` a GPU computes per micro-batch and a model of width `hidden`.

    Up to NARROW_HIDDEN: the Qwen2.5-0.5B curve (`learner.mfu_4096/8192/16384`); from WIDE_HIDDEN on: the
    GPT-OSS-20B figure (`learner.mfu_wide_8192`, one micro-batch size measured) scaled along the narrow
    curve's shape in tokens (assumed: the same relative loss for smaller micro-batches); between the two
    widths, interpolated in log2(hidden)."""
    narrow = _narrow_mfu(cal, tokens)
    if hidden <= NARROW_HIDDEN:
        return narrow
    wide = cal.get("learner.mfu_wide_8192") * narrow / _narrow_mfu(cal, 8192)
    if hidden >= WIDE_HIDDEN:
        return wide
    f = math.log2(hidden / NARROW_HIDDEN) / math.log2(WIDE_HIDDEN / NARROW_HIDDEN)
    return narrow + (wide - narrow) * f


def _bw(cluster: Cluster, group: int, stride: int) -> float:
    """Bytes/s per GPU for a collective over `group` ranks `stride` apart: NVLink inside a node, else
    the node's network shared by its GPUs."""
    if group * stride <= cluster.gpus_per_node:
        return cluster.device.nvlink_gbps * 1e9
    return cluster.inter_gbps * 1e9 / cluster.gpus_per_node


def learner_step(shape: Shape, lay: LearnerLayout, cluster: Cluster, cal: Calibration, tokens: float,
                 seq: float) -> dict[str, float]:
    """Seconds of one optimizer step on `tokens` (prompt + response) tokens, by part."""
    a, dev = shape.arch, cluster.device
    per_rank = tokens / lay.dp
    mt = micro_tokens(lay, per_rank, seq)
    micro = max(1, math.ceil(per_rank / mt))
    flops = shape.train_flops_per_token(seq)
    if lay.recompute == "full":  # every layer's forward runs again in the backward
        flops *= 4 / 3
    elif lay.recompute == "selective":  # the attention core runs again
        flops += 4 * a.num_layers * a.num_heads * a.head_dim * shape.attention_span(seq)
    per_gpu = mt / lay.tp if lay.sequence_parallel else mt  # the tokens one GPU's kernels see per micro-batch
    compute = tokens * flops / (mfu(cal, per_gpu, a.hidden_size) * dev.peak_tflops * 1e12 * lay.gpus)
    bubble = compute * (lay.pp - 1) / micro
    stage_layers = a.num_layers / lay.pp
    tp = ep = dp = 0.0
    if lay.tp > 1:  # sequence parallel: 2 all-gathers + 2 reduce-scatters forward, as many backward
        tp = micro * stage_layers * 8 * mt * a.hidden_size * 2 * (lay.tp - 1) / lay.tp / _bw(cluster, lay.tp, 1)
    if a.is_moe and lay.ep > 1:  # dispatch + combine, forward and backward
        moe_frac = shape.moe_layers / a.num_layers
        vol = 4 * mt / lay.tp * a.moe_topk * a.hidden_size * 2 * (lay.ep - 1) / lay.ep
        ep = micro * stage_layers * moe_frac * vol / _bw(cluster, lay.ep, lay.tp)
    moe = 0.0
    if a.is_moe and lay.experts == "sequential":  # the dispatcher and SequentialMLP: a cost per call, not per FLOP
        moe = micro * shape.moe_layers / lay.pp * (cal.get("learner.moe_layer_overhead_s")
                                                   + a.num_experts / lay.ep * cal.get("learner.moe_expert_overhead_s"))
    layers_dense = (shape.dense_params - shape.embedding_params) / lay.pp / lay.tp + shape.embedding_params / lay.tp
    experts = shape.expert_params / lay.pp / (lay.ep * lay.etp)
    per_param = (4 if lay.grad_fp32 else 2) + 2  # distributed optimizer: reduce-scatter grads, all-gather bf16 params
    if lay.dp > 1:
        dp += per_param * layers_dense * (lay.dp - 1) / lay.dp / _bw(cluster, lay.dp, lay.tp * lay.pp)
    if experts and lay.expert_dp > 1:
        dp += (per_param * experts * (lay.expert_dp - 1) / lay.expert_dp
               / _bw(cluster, lay.expert_dp, lay.ep * lay.etp * lay.pp))
    host = host_optimizer_s(lay, cluster, cal, layers_dense / lay.dp + experts / lay.expert_dp)
    return {"compute": compute, "bubble": bubble, "moe_overhead": moe, "tp_comm": tp, "ep_comm": ep, "dp_comm": dp,
            "host_optimizer": host, "total": compute + bubble + moe + tp + ep + dp + host}


HOST_ADAM_BYTES = 28  # host bytes an Adam step touches per parameter: reads master, m, v, grad; writes master, m, v
PCIE_BYTES = 6  # per parameter: the bf16 gradient to the host, the fp32 master weight back


def host_optimizer_s(lay: LearnerLayout, cluster: Cluster, cal: Calibration, owned: float) -> float:
    """The step's optimizer on the host (learner.megatron.optimizer_offload) for `owned` parameters a GPU updates:
    the node's learner ranks share its cores (each rank its share of torch's CPU threads), so the node steps its
    ranks' parameters at `learner.host_adam_gbps_per_core` x `Cluster.host_cores` of memory traffic; the copies
    over PCIe overlap it (offload_overlap), so the longer of the two."""
    if not lay.optimizer_offload:
        return 0.0
    ranks = min(lay.gpus, cluster.gpus_per_node)
    node_gbps = cal.get("learner.host_adam_gbps_per_core") * cluster.host_cores
    adam = lay.optimizer_offload * owned * HOST_ADAM_BYTES * ranks / (node_gbps * 1e9)
    pcie = lay.optimizer_offload * owned * PCIE_BYTES / (cluster.device.pcie_gbps * 1e9)
    return max(adam, pcie)


def gathered_publish(shape: Shape, lay: LearnerLayout | None, cal: Calibration, path: str) -> dict[str, float]:
    """The publish before the sharded one, on the learner's critical path: gather to rank 0 (Megatron layouts; None =
    the torch learner, nothing to gather) and the write. The planner models today's sharded publish (versions.py);
    this one rebuilds the recorded runs that ran it (validate.py) and is what the planner predicted with before."""
    size = shape.version_bytes()
    gather = 0.0
    if lay is not None:
        a = shape.arch
        remote = shape.moe_layers * a.num_experts * 3 * (1 - 1 / lay.ep) + a.num_layers * 12 * (1 - 1 / lay.pp)
        gather = size / (cal.get("learner.gather_gbps") * 1e9) + remote * cal.get("learner.gather_remote_tensor_s")
    write = cal.get(f"weights.publish.{path}.fixed_s") + size / (cal.get(f"weights.publish.{path}.gbps") * 1e9)
    return {"gather": gather, "write": write, "total": gather + write}


def relay_s(size: float, hop: int, cluster: Cluster, cal: Calibration, checksum: bool) -> float:
    """Seconds from the announcement until relay node `hop` (1 = first in the chain) has the version."""
    if hop <= 0:
        return 0.0
    rates = [cluster.inter_gbps, cal.get("relay.stream_gbps")] + ([cal.get("relay.sha256_gbps")] if checksum else [])
    rate = min(rates) * 1e9
    return size / rate + (hop - 1) * RELAY_WINDOW_BYTES / rate


def staged_load_s(shape: Shape, srv: RolloutServerSpec, cal: Calibration) -> float:
    """The load before the double buffer and vLLM's measured loads (what the planner predicted with before):
    each GPU its share (SGLang) or the whole (torch) at the staged rate, a stall."""
    size = shape.version_bytes()
    if srv.engine == "sglang":
        return sglang_load_s(size, srv.tp, cal)
    return cal.get("weights.load.staged.fixed_s") + size / (cal.get("weights.load.staged.gbps") * 1e9)


def sglang_load_s(size: float, tp: int, cal: Calibration) -> float:
    """An SGLang server's stall to load a version of `size` bytes: each of its `tp` GPUs its share at the assumed
    `sglang.load_gbps`, after the staged path's fixed cost."""
    return cal.get("weights.load.staged.fixed_s") + size / tp / (cal.get("sglang.load_gbps") * 1e9)
