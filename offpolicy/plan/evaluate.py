"""One candidate layout on one cluster: memory per GPU, part times, and the simulated pipeline.

A `Candidate` splits the cluster as `deploy/slurm/plan.py` does: the first `learner_nodes` nodes run
the Megatron learner (`learner`: TP/EP/PP, DP = its GPUs / (TP x PP)), the other nodes run rollout
servers of `server.tp` GPUs each (rollout i on rollout node i // servers per node, which is relay
hop i // servers per node + 1). `colocated` puts the servers on the learner's own GPUs instead
(every node: the learner's ranks and time-shared rollout servers, as the seed's hybrid runs did):
then training and generation slow each other (each server's GPUs are one shared resource) and the
memory of both must fit at once, and a learner node's host memory holds its ranks' host optimizers (with
learner.megatron.optimizer_offload) and the weight versions kept in /dev/shm. `evaluate` computes the memory (and which side runs out), the
part times from `costs`, and simulates max_staleness 0 and 1 with `simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from offpolicy.config import WeightsConfig
from offpolicy.plan import costs
from offpolicy.plan.calibration import Calibration
from offpolicy.plan.hardware import GIB, Cluster
from offpolicy.plan.memory import LearnerLayout, Memory, RolloutServerSpec, learner_memory, rollout_memory
from offpolicy.plan.shapes import Shape
from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate
from offpolicy.plan.workload import Workload


@dataclass(frozen=True)
class Candidate:
    learner_nodes: int
    learner: LearnerLayout
    server: RolloutServerSpec
    colocated: bool = False

    def servers(self, cluster: Cluster) -> int:
        nodes = cluster.nodes if self.colocated else cluster.nodes - self.learner_nodes
        return nodes * (cluster.gpus_per_node // self.server.tp)

    def hop(self, cluster: Cluster, i: int) -> int:
        """Relay hop of rollout server i (0 = the learner's head node: no relay)."""
        per_node = cluster.gpus_per_node // self.server.tp
        return i // per_node if self.colocated else 1 + i // per_node

    def label(self, cluster: Cluster) -> str:
        where = "colocated on all" if self.colocated else f"{self.learner_nodes} learner +"
        rollout_nodes = cluster.nodes if self.colocated else cluster.nodes - self.learner_nodes
        return (f"{where} {rollout_nodes} rollout nodes: learner {self.learner.label()}, "
                f"{self.servers(cluster)} x {self.server.label()}")


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


VERSIONS_HELD = WeightsConfig().keep + 1  # weights.keep versions in a learner node's /dev/shm, and one being written


def learner_host_bytes(shape: Shape, lay: LearnerLayout, cluster: Cluster, lm: Memory) -> float:
    """Host bytes of a learner node: the host optimizer of each of its learner GPUs and the versions kept."""
    return lm.host * min(lay.gpus, cluster.gpus_per_node) + VERSIONS_HELD * shape.version_bytes()


def check(shape: Shape, cluster: Cluster, cand: Candidate, wl: Workload, cal: Calibration) -> Evaluation:
    """Memory and layout problems (no simulation)."""
    problems = []
    lay, srv = cand.learner, cand.server
    gpus = (cluster.nodes if cand.colocated else cand.learner_nodes) * cluster.gpus_per_node
    if lay.gpus != gpus:
        problems.append(f"the learner layout has {lay.gpus} GPUs but {gpus} are the learner's")
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
    pub = costs.publish_parts(shape, lay, cal, wl.publish)
    size = shape.version_bytes()
    checksum = wl.publish == "sha256"
    load = costs.load_s(shape, srv, cal)

    def lease(rng: np.random.Generator, groups: int) -> tuple[float, list[int]]:
        lengths = wl.lengths.sample(rng, groups * wl.n, wl.max_new_tokens)
        seconds = costs.sglang_lease_s(shape, srv, dev, cal, lengths, wl.prompt_tokens, groups, pool_bytes)
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
    servers = tuple(ServerModel(lease, names[i], cand.hop(cluster, i), load) for i in range(n_srv))
    model = PipelineModel(batch_groups=wl.batch_groups, max_staleness=staleness, servers=servers, train_s=train_s,
                          publish_s=pub["total"], resources=resources, learner_resources=learner_res,
                          groups_per_lease=wl.lease_groups(n_srv), prefetch_leases=wl.prefetch_leases,
                          relay_s=lambda hop: costs.relay_s(size, hop, cluster, cal, checksum),
                          hub_s_per_group=cal.get("hub.group_s"))
    hops = max((cand.hop(cluster, i) for i in range(n_srv)), default=0)
    parts = {"train_s": step["total"], **{f"train_{k}_s": v for k, v in step.items() if k != "total"},
             "gather_s": pub["gather"], "write_s": pub["write"], "publish_s": pub["total"],
             "relay_s": costs.relay_s(size, hops, cluster, cal, checksum), "load_s": load,
             "groups_per_lease": wl.lease_groups(n_srv)}
    return model, parts


def evaluate(shape: Shape, cluster: Cluster, cand: Candidate, wl: Workload, cal: Calibration,
             staleness: tuple[int, ...] = (0, 1)) -> Evaluation:
    ev = check(shape, cluster, cand, wl, cal)
    if not ev.fits:
        return ev
    for s in staleness:
        model, ev.parts = pipeline(shape, cluster, cand, wl, cal, s, ev.rollout_mem.kv_cache)
        ev.runs[s] = simulate(model, wl.steps, wl.seed).summary(wl.warmup)
    return ev
