"""How much of a GPU a weight version staged beside a rollout engine may take (vLLM's `rollout.vllm.prefetch`,
SGLang's `rollout.sglang.prefetch`): the rule the engines apply (`staging.room`, `vllm/where.resolve`) and the planner
prices (`plan/versions.py`). Imports nothing heavy."""

from __future__ import annotations

DEVICE_RESERVE = 1 << 30  # GPU bytes that must stay free beside a staged copy
AUTO_DEVICE_SHARE = 0.5  # vLLM's auto: the staged copy and DEVICE_RESERVE may take this share of the GPU's free memory


def fits(nbytes: float, free: float, share: float = 1.0) -> bool:
    """`nbytes` staged on a GPU with `free` bytes free beside its engine leave DEVICE_RESERVE free, within `share` of
    `free` (AUTO_DEVICE_SHARE where vLLM's auto chooses)."""
    return nbytes + DEVICE_RESERVE <= share * free
