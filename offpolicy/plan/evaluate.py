"""One candidate layout on one cluster: memory per GPU, part times, and the simulated pipeline.

A `Candidate` splits the cluster as `deploy/slurm/plan.py` does: the first `learner_nodes` nodes run
the Megatron learner (`learner`: TP/EP/PP, DP = its GPUs / (TP x PP)), the other nodes run rollout
servers of `server.tp` GPUs each (rollout i on rollout node i // servers per node, which is relay
hop i // servers per node + 1). `learner_gpus` splits the learner's one node instead (`offpolicy run`'s
run.learner_gpus / run.rollout_gpus, e.g. 4 + 4 GPUs of one 8-GPU host): the learner takes its first
`learner_gpus` GPUs, servers the rest (hop 0: the learner's own /dev/shm, no relay), and the other nodes, if
any, serve as before. `colocated` puts the servers on the learner's own GPUs instead
(every node: the learner's ranks and time-shared rollout servers, as the seed's hybrid runs did):
then training and generation slow each other (each server's GPUs are one shared resource) and the
memory of both must fit at once, and a learner node's host memory holds its ranks' host optimizers (with
learner.megatron.optimizer_offload) and the weight versions kept in /dev/shm. `evaluate` computes the memory (and which side runs out), the
part times from `costs` and `versions` (the sharded publish in the background, the learner's stall and slowdown
for it, each engine's load; steady state: versions written into recycled page-locked files), and simulates
max_staleness 0 and 1 with `simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from offpolicy.config import WeightsConfig
from offpolicy.plan import costs, versions
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.hardware import GIB, Cluster
from offpolicy.plan.memory import LearnerLayout, Memory, RolloutServerSpec, learner_memory, rollout_memory
from offpolicy.plan.shapes import Shape
from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate
from offpolicy.plan.workload import Workload


def learner_gpu_count(cluster: Cluster, nodes: int, colocated: bool = False, learner_gpus: int = 0) -> int:
    """The learner's GPUs: every GPU when colocated, else `learner_gpus` of one node, else `nodes` whole nodes."""
    if colocated:
        return cluster.gpus
    return learner_gpus or nodes * cluster.gpus_per_node


@dataclass(frozen=True)
class Candidate:
    learner_nodes: int
    learner: LearnerLayout
    server: RolloutServerSpec
    colocated: bool = False
    learner_gpus: int = 0  # > 0: the learner's GPUs of its one node, the node's other GPUs serve (0: whole nodes)

    def gpus(self, cluster: Cluster) -> int:
        """The learner's GPUs."""
        return learner_gpu_count(cluster, self.learner_nodes, self.colocated, self.learner_gpus)

    def shared_servers(self, cluster: Cluster) -> int:
        """Servers on the learner's node beside it (`learner_gpus`)."""
        if self.colocated or not self.learner_gpus:
            return 0
        return max(0, cluster.gpus_per_node - self.learner_gpus) // self.server.tp

    def servers(self, cluster: Cluster) -> int:
        nodes = cluster.nodes if self.colocated else cluster.nodes - self.learner_nodes
        return self.shared_servers(cluster) + nodes * (cluster.gpus_per_node // self.server.tp)

    def hop(self, cluster: Cluster, i: int) -> int:
        """Relay hop of rollout server i (0 = the learner's head node: no relay)."""
        per_node = cluster.gpus_per_node // self.server.tp
        if self.colocated:
            return i // per_node
        shared = self.shared_servers(cluster)
        return 0 if i < shared else 1 + (i - shared) // per_node

    def label(self, cluster: Cluster) -> str:
        what = f"learner {self.learner.label()}, {self.servers(cluster)} x {self.server.label()}"
        if self.learner_gpus:
            more = cluster.nodes - self.learner_nodes
            return (f"{self.learner_gpus} learner + {cluster.gpus_per_node - self.learner_gpus} rollout GPUs of node 1"
                    + (f" + {more} rollout nodes" if more else "") + f": {what}")
        where = "colocated on all" if self.colocated else f"{self.learner_nodes} learner +"
        rollout_nodes = cluster.nodes if self.colocated else cluster.nodes - self.learner_nodes
        return f"{where} {rollout_nodes} rollout nodes: {what}"


@dataclass
class Evaluation:
    candidate: Candidate
    learner_mem: Memory
    rollout_mem: Memory
    problems: list[str]
    parts: dict[str, float] = field(default_factory=dict)
    runs: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems

    def speedup(self) -> float:
        return self.runs[0]["step_s"] / self.runs[1]["step_s"] if 0 in self.runs and 1 in self.runs else float("nan")

    def speedup_bound(self, k: int = 1) -> float:
        """What staleness k can give at most (bench/pipeline.py `speedups`): min(T_step(0) / max(G, T_train), k + 1),
        G and T_train of the staleness-k run."""
        if 0 not in self.runs or k not in self.runs:
            return float("nan")
        r = self.runs[k]
        return min(self.runs[0]["step_s"] / max(r["gen_busy_s"], r["train_s"], 1e-12), k + 1)


VERSIONS_HELD = WeightsConfig().keep + 1  # weights.keep versions in a learner node's /dev/shm, and one being written


def learner_host_bytes(shape: Shape, lay: LearnerLayout, cluster: Cluster, lm: Memory) -> float:
    """Host bytes of a learner node: the host optimizer of each of its learner GPUs and the versions kept."""
    return lm.host * min(lay.gpus, cluster.gpus_per_node) + VERSIONS_HELD * shape.version_bytes()


def check(shape: Shape, cluster: Cluster, cand: Candidate, wl: Workload, cal: Calibration) -> Evaluation:
    """Memory and layout problems (no simulation)."""
    problems = []
    lay, srv = cand.learner, cand.server
    gpus = cand.gpus(cluster)
    if lay.gpus != gpus:
        problems.append(f"the learner layout has {lay.gpus} GPUs but {gpus} are the learner's")
    if cand.learner_gpus and (cand.colocated or cand.learner_nodes != 1 or cand.learner_gpus >= cluster.gpus_per_node):
        problems.append(f"learner_gpus {cand.learner_gpus} splits one node: it needs learner_nodes=1, no colocation "
                        f"and fewer than the node's {cluster.gpus_per_node} GPUs")
    elif cand.learner_gpus and (cluster.gpus_per_node - cand.learner_gpus) % srv.tp:
        problems.append(f"the node's {cluster.gpus_per_node - cand.learner_gpus} GPUs beside the learner are not "
                        f"servers of TP{srv.tp}")
    why = lay.check(shape)
    if why:
        problems.append(f"learner: {why}")
    if cluster.gpus_per_node % srv.tp or shape.arch.num_query_groups % min(srv.tp, shape.arch.num_query_groups):
        problems.append(f"rollout TP{srv.tp} does not fit {cluster.gpus_per_node} GPUs per node / the KV heads")
    if cand.servers(cluster) < 1:
        problems.append("no rollout server")
    mem = cluster.device.mem_gib * GIB
    seq_worst = wl.prompt_tokens + wl.max_new_tokens
    tokens = wl.batch_groups * wl.n * wl.seq_len()
    lm = learner_memory(shape, lay, seq_worst, int(tokens / max(1, lay.dp)))
    budget = srv.mem_fraction * mem - (lm.total if cand.colocated else 0.0)  # colocated: the learner's share is gone
    rm = rollout_memory(shape, srv, max(0.0, budget))
    if lm.total > mem:
        problems.append(f"learner OOM: {lm.total / GIB:.1f} GiB per GPU of {cluster.device.mem_gib:.0f}")
    host = learner_host_bytes(shape, lay, cluster, lm)
    if host > cluster.host_gib * GIB:
        problems.append(f"learner host OOM: {host / GIB:.0f} GiB on a learner node (the host optimizer's "
                        f"{lm.host / GIB:.1f} GiB a GPU and {VERSIONS_HELD} weight versions in /dev/shm) of "
                        f"{cluster.host_gib:.0f}")
    one_row = shape.kv_bytes(seq_worst) / srv.tp
    if rm.kv_cache < one_row:
        problems.append(f"rollout OOM: weights {rm.params / GIB:.1f} GiB + KV of one {seq_worst}-token sequence "
                        f"{one_row / GIB:.2f} GiB per GPU exceed {srv.mem_fraction:g} x "
                        f"{cluster.device.mem_gib:.0f} GiB" + (" after the learner's share" if cand.colocated else ""))
    return Evaluation(cand, lm, rm, problems)


def pipeline(shape: Shape, cluster: Cluster, cand: Candidate, wl: Workload, cal: Calibration,
             staleness: int, pool_bytes: float) -> tuple[PipelineModel, dict[str, float]]:
    """The simulation model of a candidate (KV pool `pool_bytes` per rollout GPU) and its part times."""
    lay, srv, dev = cand.learner, cand.server, cluster.device
    n_srv = cand.servers(cluster)
    seq = wl.seq_len()
    tokens_mean = wl.batch_groups * wl.n * seq
    step = costs.learner_step(shape, lay, cluster, cal, tokens_mean, seq)
    pub = versions.publish(shape, lay, cluster, cal, wl.publish, srv.expert_bits)
    size = versions.version_bytes(shape, srv.expert_bits)
    checksum = wl.publish == "sha256"
    load = versions.load(shape, srv, cal, dev.mem_gib * GIB, cand.colocated)

    dec = replace(srv, expert_bits=16.0) if srv.engine == "torch" else srv  # the torch engine decodes in bf16

    def lease(rng: np.random.Generator, groups: int) -> tuple[float, list[int]]:
        lengths = wl.lengths.sample(rng, groups * wl.n, wl.max_new_tokens)
        seconds = costs.sglang_lease_s(shape, dec, dev, cal, lengths, wl.prompt_tokens, groups, pool_bytes)
        return seconds, [int(x) for x in lengths.reshape(groups, wl.n).sum(1)]

    per_token = step["total"] / tokens_mean

    def train_s(tokens: int) -> float:  # response tokens of the batch -> step seconds (prompts added)
        return per_token * (tokens + wl.batch_groups * wl.n * wl.prompt_tokens)

    names = [f"s{i}" for i in range(n_srv)]
    resources = {name: 1.0 for name in names}
    if cand.colocated:
        learner_res = tuple(names)
    else:
        resources["learner"] = 1.0
        learner_res = ("learner",)
    fresh = versions.FRESH_VERSIONS if wl.fresh_pages else 0
    servers = tuple(ServerModel(lease, names[i], cand.hop(cluster, i), load["seconds"], load["background"],
                                load["fresh"], load["swap"]) for i in range(n_srv))
    model = PipelineModel(batch_groups=wl.batch_groups, max_staleness=staleness, servers=servers, train_s=train_s,
                          publish_s=pub["write"], resources=resources, learner_resources=learner_res,
                          groups_per_lease=wl.lease_groups(n_srv), prefetch_leases=wl.prefetch_leases,
                          relay_s=lambda hop: costs.relay_s(size, hop, cluster, cal, checksum),
                          hub_s_per_group=cal.get("hub.group_s"), stall_s=pub["stall"],
                          slowdown=cal.get("learner.publish_slowdown"), fresh_versions=fresh,
                          fresh_publish_s=pub["fresh"])
    hops = max((cand.hop(cluster, i) for i in range(n_srv)), default=0)
    parts = {"train_s": step["total"], **{f"train_{k}_s": v for k, v in step.items() if k != "total"},
             "publish_s": pub["write"], "stall_s": pub["stall"], "version_gb": size / 1e9,
             "relay_s": costs.relay_s(size, hops, cluster, cal, checksum), "load_s": load["seconds"],
             "load_background": bool(load["background"]), "load_swap_s": load["swap"],
             "load_method": load_label(srv, str(load["staged"])),
             "groups_per_lease": wl.lease_groups(n_srv)}
    return model, parts


def load_label(srv: RolloutServerSpec, staged: str) -> str:
    """How a server loads (versions.load_method), and where a version is staged ahead of it."""
    how = versions.load_method(srv)
    if staged == "direct":
        return f"{how}, read onto the GPU at the load"
    if staged:
        return f"{how}, staged on the {'GPU' if staged == 'device' else 'host'}"
    if srv.stage == "device" and how in ("inplace", "stall"):
        return f"{how}: stage device does not fit beside the server, from the files"
    return how


def evaluate(shape: Shape, cluster: Cluster, cand: Candidate, wl: Workload, cal: Calibration,
             staleness: tuple[int, ...] = (0, 1)) -> Evaluation:
    ev = check(shape, cluster, cand, wl, cal)
    if not ev.fits:
        return ev
    for s in staleness:
        model, ev.parts = pipeline(shape, cluster, cand, wl, cal, s, ev.rollout_mem.kv_cache)
        ev.runs[s] = simulate(model, wl.steps, wl.seed).summary(wl.warmup, period=s + 1)
    return ev
