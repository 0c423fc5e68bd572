"""Candidate layouts of a cluster: every learner/rollout node split, learner layout and server size.

For each number of learner nodes the learner layouts (TP within a node, PP dividing the layers, EP
dividing the experts, ETP 1, micro-batch budget and recompute) that fit memory are ranked by their
predicted step time and the fastest is kept; each is paired with every rollout server size (TP =
EP = 1, 2, 4, 8 GPUs, as SGLang splits a MoE over its TP group; the torch engine: 1) of the engine asked for. A cluster of one node is split within
it instead (`learner_gpus`: 1, 2, 4, ... of its GPUs for the learner, the rest for servers). `parse_layout`
reads one layout from the command line (`learner_nodes=2,tp=2,ep=8,pp=1,rollout_tp=4`, or
`learner_gpus=4,tp=1,ep=4,pp=1,rollout_tp=1` on one node), so a user's own candidates go through the same
evaluation. Ranking: tokens/s at max_staleness 1, layouts that do not fit last.
"""

from __future__ import annotations

import dataclasses

from offpolicy.plan import costs
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.evaluate import Candidate, Evaluation, check, evaluate, learner_gpu_count
from offpolicy.plan.hardware import Cluster
from offpolicy.plan.memory import LearnerLayout, RolloutServerSpec
from offpolicy.plan.shapes import Shape
from offpolicy.plan.versions import LOAD_METHODS, STAGES
from offpolicy.plan.workload import Workload

ENGINES = ("sglang", "vllm", "torch")

BUDGETS = (16384, 8192, 4096)
RECOMPUTE = ("none", "selective", "full")
_KEYS = {"learner_nodes", "learner_gpus", "tp", "pp", "ep", "etp", "max_tokens", "recompute", "offload", "grad_fp32",
         "microbatches", "rollout_tp", "rollout_ep", "expert_bits", "mem_fraction", "max_running", "colocated",
         "rollout_engine", "load", "stage"}
_TRUE = ("1", "true", "yes")


def learner_layouts(shape: Shape, gpus: int, gpus_per_node: int, offload: bool = False) -> list[LearnerLayout]:
    """Every layout of `gpus` GPUs the model allows, each budget and recompute; `offload`: with the optimizer on the
    host and bf16 gradient buffers (learner.megatron.optimizer_offload=1.0, grad_reduce_in_fp32=false)."""
    a = shape.arch
    out = []
    for tp in (t for t in (1, 2, 4, 8) if t <= gpus_per_node):
        for pp in (p for p in (1, 2, 3, 4, 6, 8) if a.num_layers % p == 0):
            if gpus % (tp * pp):
                continue
            eps = [e for e in range(1, a.num_experts + 1) if a.num_experts % e == 0] if a.is_moe else [1]
            for ep in eps:
                for budget in BUDGETS:
                    for rc in RECOMPUTE:
                        lay = LearnerLayout(gpus, tp, pp, ep, 1, budget, rc, optimizer_offload=1.0 if offload else 0.0,
                                            grad_fp32=not offload)
                        if lay.check(shape) is None:
                            out.append(lay)
    return out


def best_learner(shape: Shape, cluster: Cluster, nodes: int, wl: Workload, cal: Calibration,
                 server: RolloutServerSpec, colocated: bool = False, learner_gpus: int = 0) -> LearnerLayout | None:
    """The learner layout on `nodes` nodes (`learner_gpus` of one node) with the shortest predicted step among
    those that fit; with the optimizer on the host only where none fits with it on the GPUs."""
    gpus = learner_gpu_count(cluster, nodes, colocated, learner_gpus)
    seq = wl.seq_len()
    tokens = wl.batch_groups * wl.n * seq
    for offload in (False, True):
        best, best_s = None, float("inf")
        for lay in learner_layouts(shape, gpus, cluster.gpus_per_node, offload):
            ev = check(shape, cluster, Candidate(nodes, lay, server, colocated, learner_gpus), wl, cal)
            if any(p.startswith(("learner", "the learner")) for p in ev.problems):
                continue
            t = costs.learner_step(shape, lay, cluster, cal, tokens, seq)["total"]
            if t < best_s:
                best, best_s = lay, t
        if best is not None:
            return best
    return None


def candidates(shape: Shape, cluster: Cluster, wl: Workload, cal: Calibration,
               server_tps: tuple[int, ...] = (1, 2, 4, 8), expert_bits: float = 16.0,
               engine: str = "sglang") -> list[Candidate]:
    out = []
    if engine == "torch":
        server_tps = (1,)  # the torch engine: one GPU a daemon
    for tp in (t for t in server_tps if t <= cluster.gpus_per_node and cluster.gpus_per_node % t == 0):
        srv = RolloutServerSpec(engine, tp, tp if shape.arch.is_moe else 1, expert_bits)
        for nodes in range(1, cluster.nodes):
            lay = best_learner(shape, cluster, nodes, wl, cal, srv)
            if lay is not None:
                out.append(Candidate(nodes, lay, srv))
        if cluster.nodes == 1:  # one node: the learner on a power of two of its GPUs, servers on the rest
            for gpus in (g for g in (1, 2, 4, 8, 16) if g < cluster.gpus_per_node
                         and (cluster.gpus_per_node - g) % tp == 0):
                lay = best_learner(shape, cluster, 1, wl, cal, srv, learner_gpus=gpus)
                if lay is not None:
                    out.append(Candidate(1, lay, srv, learner_gpus=gpus))
    return out


def parse_layout(text: str, shape: Shape, cluster: Cluster, wl: Workload, cal: Calibration,
                 expert_bits: float = 16.0, engine: str = "sglang") -> Candidate:
    """`key=value,...` with keys learner_nodes, learner_gpus (the learner's GPUs of its one node, the rest serving),
    tp, pp, ep, etp, max_tokens, recompute, offload (the fraction of the optimizer on the host, with bf16 gradient
    buffers), grad_fp32 (false: bf16 gradient buffers, learner.megatron.grad_reduce_in_fp32; default: false with
    offload, else true), microbatches (learner.megatron.pp_microbatches: auto or the fewest micro-batches a rank with
    pp > 1), rollout_tp, rollout_ep, expert_bits, mem_fraction, max_running, colocated, rollout_engine
    (sglang, vllm, torch; default `engine`), load (vLLM's load_method: auto, inplace, rebuild), stage (where each
    version is staged ahead: vLLM's rollout.vllm.prefetch auto, hash, host, device; SGLang's rollout.sglang.prefetch
    auto (= disk), disk, device); learner keys left out are searched."""
    kv = {}
    for item in filter(None, text.split(",")):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in _KEYS:
            raise ValueError(f"--layout {text!r}: {item!r} is not key=value with a key in {', '.join(sorted(_KEYS))}")
        kv[k.strip()] = v.strip()
    colocated = kv.get("colocated", "false").lower() in _TRUE
    nodes = int(kv.get("learner_nodes", cluster.nodes if colocated else 1))
    learner_gpus = int(kv.get("learner_gpus", 0))
    rtp = int(kv.get("rollout_tp", 1))
    eng, how = kv.get("rollout_engine", engine), kv.get("load", "auto")
    if eng not in ENGINES or how not in LOAD_METHODS or (eng == "torch" and rtp != 1):
        raise ValueError(f"--layout {text!r}: rollout_engine is one of {', '.join(ENGINES)} (torch: rollout_tp=1), "
                         f"load one of {', '.join(LOAD_METHODS)}")
    stage = kv.get("stage", "auto")
    if stage not in STAGES[eng]:
        raise ValueError(f"--layout {text!r}: stage for {eng} is one of {', '.join(STAGES[eng])}")
    srv = RolloutServerSpec(eng, rtp, int(kv.get("rollout_ep", rtp if shape.arch.is_moe else 1)),
                            float(kv.get("expert_bits", expert_bits)), float(kv.get("mem_fraction", 0.8)),
                            int(kv.get("max_running", 512)), how, stage)
    gpus = learner_gpu_count(cluster, nodes, colocated, learner_gpus)
    micro = kv.get("microbatches", "auto")
    if micro != "auto" and not (micro.isdigit() and int(micro) >= 1):
        raise ValueError(f"--layout {text!r}: microbatches is auto or a whole number >= 1, not {micro!r}")
    micro = micro if micro == "auto" else int(micro)
    learner_keys = {"tp", "pp", "ep", "etp", "max_tokens", "recompute"} & kv.keys()
    if learner_keys >= {"tp", "pp", "ep"}:
        off = float(kv.get("offload", 0))
        lay = LearnerLayout(gpus, int(kv["tp"]), int(kv["pp"]), int(kv["ep"]), int(kv.get("etp", 1)),
                            int(kv.get("max_tokens", 8192)), kv.get("recompute", "none"), optimizer_offload=off,
                            grad_fp32=kv["grad_fp32"].lower() in _TRUE if "grad_fp32" in kv else not off,
                            pp_microbatches=micro)
    else:
        found = best_learner(shape, cluster, nodes, wl, cal, srv, colocated, learner_gpus)
        if found is None:
            raise ValueError(f"--layout {text!r}: no learner layout on {gpus} GPUs fits memory; give tp, pp, ep")
        fixed = {k: int(kv[k]) for k in ("tp", "pp", "ep") if k in kv}
        lay = dataclasses.replace(found, **fixed, **({"etp": 1} if fixed else {}), pp_microbatches=micro)
    return Candidate(nodes, lay, srv, colocated, learner_gpus)


def rank(evals: list[Evaluation]) -> list[Evaluation]:
    """Best first: layouts that fit by tokens/s at max_staleness 1, then the ones that do not fit."""
    return sorted(evals, key=lambda e: (not e.fits, -(e.runs.get(1) or e.runs.get(0) or {}).get("tokens_per_s", 0.0)))


def plan(shape: Shape, cluster: Cluster, wl: Workload, cal: Calibration, layouts: list[Candidate] | None = None,
         expert_bits: float = 16.0, engine: str = "sglang") -> list[Evaluation]:
    cands = layouts if layouts is not None else candidates(shape, cluster, wl, cal, expert_bits=expert_bits,
                                                           engine=engine)
    return rank([evaluate(shape, cluster, c, wl, cal) for c in cands])
