"""Checkpoints of the megatron backend: write in the configured format, read whichever format is on disk.

`learner.megatron.checkpoint_format` picks what `save` writes: `dist` (default, `distributed`:
Megatron's distributed checkpoint, which loads under another tp/pp/dp/ep/etp layout) or `per_rank`
(`per_rank`: one `rank<R>.pt` per rank, resumable only under the same layout). `load` looks at
the directory (`offpolicy_megatron.json` or `layout.json`), so checkpoints of either format, including
those written before the dist format existed, resume whatever the knob says now. Both are collectives
over all learner ranks, on a directory every rank sees.
"""

from __future__ import annotations

from pathlib import Path

from offpolicy.learner.backends.megatron.checkpointing import distributed, per_rank


def save(path: str, *, fmt: str, rank: int, layout: dict, model, params: dict, opt, control) -> None:
    if fmt == "dist":
        distributed.save(path, model=model, opt=opt, layout=layout, control=control)
    elif fmt == "per_rank":
        per_rank.save(path, rank=rank, layout=_rank_layout(layout), params=params, opt=opt, control=control)
    else:
        raise ValueError(f"learner.megatron.checkpoint_format {fmt!r}: use 'dist' or 'per_rank'")


def load(path: str, *, rank: int, layout: dict, model, params: dict, opt, control) -> None:
    if distributed.is_dist_checkpoint(path):
        distributed.load(path, model=model, opt=opt, layout=layout, control=control)
    elif (Path(path) / "layout.json").exists():
        per_rank.load(path, rank=rank, layout=_rank_layout(layout), params=params, opt=opt, control=control)
    else:
        raise ValueError(f"{path} holds no megatron backend checkpoint (neither {distributed.META_FILE} nor "
                         "layout.json): it is incomplete or not a checkpoint of learner.backend=megatron; resume "
                         "from another checkpoint or start the run anew")


def _rank_layout(layout: dict) -> dict:
    """What a per_rank checkpoint must match (its layout.json): tp, pp, world, for MoE models ep/etp and the
    experts module (per_rank files hold Megatron parameter names, which differ between the two), and whether the
    optimizer is on the host (learner.megatron.optimizer_offload: its state dict has other keys)."""
    keys = ("tp", "pp", "world", "ep", "etp", "experts") if layout["moe"] else ("tp", "pp", "world")
    out = {k: layout.get(k, "grouped") if k == "experts" else layout[k] for k in keys}
    if layout.get("offload"):  # the host optimizer's state dict differs from torch Adam's (and not written before)
        out["offload"] = True
    return out
