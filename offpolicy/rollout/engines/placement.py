"""Where a rollout's engine sits against the learner: the GPUs `offpolicy run` gives both (run.learner_gpus,
run.rollout_gpus). An engine on a learner GPU must leave the memory the learner grows into: SGLang's KV pool
(sglang/local.py `shared_gpu_warning`) and the staging of a version on the GPU (vllm/engine.py `prefetch_setting`,
sglang/staged.py `prefetch_of`)."""

from __future__ import annotations

from offpolicy.config import Config


def shared_with_learner(cfg: Config) -> list[str]:
    """The GPUs that run.rollout_gpus (entries like "0" or "0,1") shares with run.learner_gpus, sorted."""
    learner = {str(g) for g in cfg.run.learner_gpus}
    rollout = {g.strip() for entry in cfg.run.rollout_gpus for g in str(entry).split(",")}
    return sorted(learner & rollout)
