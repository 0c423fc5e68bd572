"""The per-rank checkpoint format of the megatron backend (`learner.megatron.checkpoint_format: per_rank`).

The default format is Megatron's distributed checkpoint (dist_checkpoint.py), which reshards; this one
does not. Each rank writes `rank<R>.pt` with its model shards (Megatron names) and, for every optimizer that
`get_megatron_optimizer` chained, the wrapped torch optimizer's state dict, its (fp32 main) parameters
in order, and the grad scaler's state when there is one. Rank 0 writes `layout.json`. Loading needs the
same tp/pp and world size (checked against `layout.json`). This deliberately bypasses the distributed
optimizer's `save/load_parameter_state`: in megatron-core 0.16 its loader copies torch Adam's per-parameter
`step` into a missing key when neither Apex nor TE is installed. The files are loaded with
`weights_only=False` (Megatron state dicts hold plain Python objects): load only checkpoints you wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def chained(opt) -> list:
    """The optimizers `get_megatron_optimizer` chained (MoE: dense and expert), or `opt` alone."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def _main_params(o) -> list[torch.Tensor]:
    return [p for g in o.optimizer.param_groups for p in g["params"]]


def save(path: str, *, rank: int, layout: dict, params: dict[str, torch.Tensor], opt, control) -> None:
    """Write this rank's files into `path` (a directory every rank sees); a collective over `control`."""
    root = Path(path)
    optims = []
    for o in chained(opt):
        scaler = getattr(o, "grad_scaler", None)
        optims.append(dict(state=o.optimizer.state_dict(), main=[p.detach().cpu() for p in _main_params(o)],
                           scaler=scaler.state_dict() if scaler is not None else None))
    model = {k: v.detach().cpu() for k, v in params.items()}
    torch.save({"model": model, "optimizers": optims}, root / f"rank{rank:05d}.pt")
    if rank == 0:
        (root / "layout.json").write_text(json.dumps(layout))
    dist.barrier(group=control)


def load(path: str, *, rank: int, layout: dict, params: dict[str, torch.Tensor], opt, control) -> None:
    """Restore this rank's model shards and optimizer state from `path`; a collective over `control`."""
    root = Path(path)
    saved_layout = json.loads((root / "layout.json").read_text())
    if "experts" in layout:  # MoE checkpoints written before learner.megatron.experts existed hold SequentialMLP's
        saved_layout.setdefault("experts", "sequential")
    if saved_layout != layout:
        raise ValueError(f"checkpoint {path} was written with layout {saved_layout}, this learner has {layout}: "
                         "resume with the same learner.megatron.tp/pp/ep/etp/experts, optimizer_offload (0 or not) "
                         "and number of ranks (a per_rank checkpoint does not reshard; checkpoint_format=dist "
                         "checkpoints do, and move between an optimizer on the GPU and one on the host)")
    state = torch.load(root / f"rank{rank:05d}.pt", weights_only=False, map_location="cpu")
    optims = chained(opt)
    if len(optims) != len(state["optimizers"]):
        raise ValueError(f"checkpoint {path} has {len(state['optimizers'])} optimizers, this model {len(optims)}")
    with torch.no_grad():  # fp32 main params of the distributed optimizer are views of model params
        for name, p in params.items():
            p.copy_(state["model"][name])
        for o, saved in zip(optims, state["optimizers"]):
            o.optimizer.load_state_dict(saved["state"])
            for p, value in zip(_main_params(o), saved["main"], strict=True):
                p.copy_(value)
            if saved["scaler"] is not None:
                o.grad_scaler.load_state_dict(saved["scaler"])
    dist.barrier(group=control)
