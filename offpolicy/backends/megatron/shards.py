"""This rank's share of a weight version, for the sharded publish (offpolicy/weights/sharded.py).

`local_pieces(model, arch, par, te=..., grouped=...)` is a collective of every rank, run in step like
`model.gather`, but nothing leaves the group that holds a parameter: the ranks holding a stage's
parameters (data-parallel rank 0's TP group; for experts, expert-data-parallel rank 0's ETP group of
their EP rank) all-gather each TP/ETP-split parameter inside the group, and one member of the group,
the parameter's writer, turns the shards into its checkpoint tensors (`mapping.from_shards`, then the
family's `export_pieces`: whole tensors, or an EP rank's experts' rows of a fused GPT-OSS tensor). The
writers of a group are chosen by bytes, greedily (each parameter to the member with the fewest bytes so
far, ties to the lowest), so the group's ranks write about equal shares; every member computes the same
choice from the shard shapes it holds.

Returns this rank's pieces: (checkpoint name, first row or None for a whole tensor, tensor, order),
where `order` = (stage, parameter index, output index) is the tensor's place in `model.gather`'s stream.
The tensors are a snapshot: they never share memory with a parameter (the next step may change those
while the pieces are still being written), so they cost, on this rank, about its share of the model in
the model's dtype (`memory.publish_snapshot_bytes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from offpolicy.backends.megatron import families, mapping
from offpolicy.backends.megatron.arch import Arch
from offpolicy.backends.megatron.model import named

Piece = tuple[str, "int | None", torch.Tensor, tuple[int, ...]]


def local_pieces(model, arch: Arch, par, *, te: bool, grouped: bool = True) -> list[Piece]:
    params = named(model)
    family = families.get(arch.model_type)
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    loads = {"dense": [0] * par.tp, "expert": [0] * par.etp}  # bytes given to each group member so far
    out: list[Piece] = []
    for i, p in enumerate(families.stage_params(arch, par.pp_rank, par.pp, te=te, ep=par.ep, grouped=grouped)):
        if not p.export:
            continue
        if p.ep_rank is None:
            holds, size, group, me, kind = par.dp_rank == 0, par.tp, par.tp_group, par.tp_rank, "dense"
        else:
            holds, size, group, me, kind = (par.ep_rank == p.ep_rank and par.edp_rank == 0, par.etp, par.etp_group,
                                            par.etp_rank, "expert")
        if not holds:
            continue
        local = params[p.name].detach()
        load = loads[kind]
        writer = min(range(size), key=lambda r: (load[r], r))
        load[writer] += local.numel() * local.element_size() * (1 if p.kind == "rep" else size)
        if p.kind == "rep" or size == 1:
            shards = [local] * size
        else:
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local.contiguous(), group=group)
        if me != writer:
            continue
        hf = mapping.from_shards(p, shards, arch)
        for j, (name, row, t) in enumerate(family.export_pieces(arch, hf)):
            t = t.contiguous()
            if t.untyped_storage().data_ptr() in storages:  # a view of the parameter itself: snapshot it
                t = t.clone()
            out.append((name, row, t, (par.pp_rank, i, j)))
    return out
