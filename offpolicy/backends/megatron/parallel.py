"""Ranks from the launcher's environment, and torch.distributed + Megatron parallel state from config.

`rank_env()` reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID
(srun); with neither it is a single process (rank 0 of 1). It imports nothing heavy, so the learner
entry point can decide between hub and worker before importing torch. `init(cfg)` starts the default
process group (NCCL on GPU, gloo on CPU), a gloo group for control messages (commands and batches
travel as pickled objects from rank 0, the hub), and Megatron's model-parallel groups. Invariant:
world size = tp x pp x cp x dp, and global rank 0 is tp rank 0, pp rank 0, dp rank 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
        model_parallel = m.tp * m.pp * m.cp
        if env.world_size % model_parallel:
            raise ValueError(f"world size {env.world_size} is not a multiple of megatron.tp x pp x cp = "
                             f"{model_parallel}: start tp*pp*cp*dp learner ranks")
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
        # global ranks of the pipeline that holds global rank 0 (tp 0, dp 0): the weight senders
        self.pipeline0 = [s * (self.world // m.pp) for s in range(m.pp)]

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled over the gloo control group)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]
