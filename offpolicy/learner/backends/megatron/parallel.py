"""Ranks from the launcher's environment, and torch.distributed + Megatron parallel state from config.

`rank_env()` reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID
(srun); with neither it is a single process (rank 0 of 1). It imports nothing heavy, so the learner
entry point can decide between hub and worker before importing torch. `init(cfg)` starts the default
process group (NCCL on GPU, gloo on CPU), a gloo group for control messages (commands and batches
travel as pickled objects from rank 0, the hub), and Megatron's model-parallel groups, expert groups
included (`ep` x `etp` x expert-dp re-folds the tp x cp x dp ranks of each pipeline stage for the MoE
layers). `owner(stage, ep_rank)` names the global rank that sends a stage's (experts') full weights to
rank 0. `node` / `node_of` number the machines (by host name, or OFFPOLICY_NODE where a test stands
several nodes on one machine) in rank order: each writes its shards of a weight version into its own store. Invariant: world size = tp x pp x cp x dp = etp x ep x pp x expert-dp, and global rank 0 is tp
rank 0, pp rank 0, dp rank 0, ep rank 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offpolicy.config.checks import check_world  # noqa: F401 (re-exported: torch-free, plan.py uses it too)


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int


def rank_env(environ: dict[str, str] | None = None) -> RankEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return RankEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")))
    return RankEnv(0, 1, 0)


class Parallel:
    """This process's place in the layout: device, groups and the ranks it needs."""

    def __init__(self, cfg):
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        m = cfg.learner.megatron
        env = rank_env()
        check_world(env.world_size, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, etp=m.etp)
        use_cuda = cfg.learner.device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(env.local_rank)
        self.device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(m.master_port))
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size)
        self.control = dist.new_group(backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
                                     context_parallel_size=m.cp, expert_model_parallel_size=m.ep,
                                     expert_tensor_parallel_size=m.etp)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.model.seed)
        self.rank, self.world = env.rank, env.world_size
        self.tp, self.pp, self.dp = m.tp, m.pp, ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        self.ep, self.etp = m.ep, m.etp
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.edp = ps.get_expert_data_parallel_world_size()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        import socket

        host = os.environ.get("OFFPOLICY_NODE") or socket.gethostname()
        me = (self.pp_rank, self.tp_rank, self.dp_rank, self.ep_rank, self.etp_rank, self.edp_rank, host)
        table = [me] * self.world
        if self.world > 1:  # every rank's coordinates, to find the weight senders without Megatron's rank order
            dist.all_gather_object(table, me, group=self.control)
        self._table = table
        hosts = list(dict.fromkeys(c[6] for c in table))  # nodes numbered in the order of their first rank
        self.node_of = [hosts.index(c[6]) for c in table]
        self.node = self.node_of[self.rank]
        tp_nodes: dict[tuple, set[int]] = {}  # a TP group = the ranks of one pipeline stage and data-parallel rank
        for r, c in enumerate(table):
            tp_nodes.setdefault((c[0], c[2]), set()).add(self.node_of[r])
        self.tp_one_node = all(len(nodes) == 1 for nodes in tp_nodes.values())  # every TP group on one machine
        # global ranks of the pipeline that holds global rank 0 (tp 0, dp 0): the weight senders
        self.pipeline0 = [self.owner(s) for s in range(m.pp)]

    def owner(self, stage: int, ep_rank: int | None = None) -> int:
        """The lowest global rank of pipeline stage `stage` with tp (or, for `ep_rank`'s experts, etp) rank 0
        and (expert-)data-parallel rank 0: it holds the merged full tensors of that stage's parameters."""
        if ep_rank is None:
            return min(r for r, c in enumerate(self._table) if c[0] == stage and c[1] == 0 and c[2] == 0)
        return min(r for r, c in enumerate(self._table)
                   if c[0] == stage and c[3] == ep_rank and c[4] == 0 and c[5] == 0)

    def share(self, obj=None):
        """Rank 0's `obj` on every rank (pickled over the gloo control group); a one-rank learner's own `obj`, as
        it is (pickling a step's batch would keep the GPU waiting for nothing)."""
        import torch.distributed as dist

        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]
