"""torch AdamW's fused kernel for the Megatron learner (`learner.megatron.fused_adam`).

Without Apex or Transformer Engine, megatron-core's optimizer wraps `torch.optim.AdamW` with its default
multi-tensor ("foreach") implementation, which passes over the parameters, gradients and moments several
times (its share of a step: docs/benchmarks.md). The fused implementation
does one pass. `fuse(opt)` switches every torch Adam that `get_megatron_optimizer` chained to it;
`place_steps(opt)` moves each parameter's `step` to the parameter's device as float32, as the fused
kernel needs it, and runs before every optimizer step: the checkpoint code (dist_checkpoint.py) creates
and restores steps as host tensors, and a load replaces the param groups with the saved ones, so `fuse`
runs again after a load. The result is the same update up to float32 rounding (CPU test on gloo).
"""

from __future__ import annotations

import torch

from offpolicy.learner.backends.megatron.checkpointing.per_rank import chained


def _torch_adams(opt) -> list[torch.optim.Optimizer]:
    return [o.optimizer for o in chained(opt) if isinstance(o.optimizer, (torch.optim.Adam, torch.optim.AdamW))]


def fuse(opt) -> None:
    """Switch every torch Adam of `opt` (a Megatron optimizer, chained or not) to the fused kernel."""
    for inner in _torch_adams(opt):
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
    place_steps(opt)


def place_steps(opt) -> None:
    """Each parameter's `step` on the parameter's device, float32 (no-op where it is already)."""
    for inner in _torch_adams(opt):
        if not all(g.get("fused") for g in inner.param_groups):
            continue
        for p, state in inner.state.items():
            step = state.get("step")
            placed = torch.is_tensor(step) and step.device == p.device and step.dtype == torch.float32
            if step is not None and not placed:
                state["step"] = torch.as_tensor(step, dtype=torch.float32, device=p.device).clone()
