"""This rank's share of a weight version, for the sharded publish (offpolicy/weights/sharded.py).

`local_pieces(model, arch, par, te=..., grouped=...)` is a collective of every rank, run in step like
`model.gather`, but nothing leaves the group that holds a parameter: a stage's parameters are held by
every data-parallel replica's TP group (experts: every expert-data-parallel replica's ETP group of their
EP rank), identical after each step. Each parameter goes to one replica and one member of its group, its
writer, chosen by bytes, greedily (to the (replica, member) with the fewest bytes so far, ties to the
lowest), so the replicas and the ranks of a group write about equal shares (under EP2 on 2 GPUs both
ranks write half the dense tensors, not rank 0 all of them); every rank computes the same choice from
the shard shapes it holds. A learner on several nodes keeps replica 0 as the only writer (its nodes'
stores then hold the parts they always held, and a fused tensor's rows stay on one node). That replica's group all-gathers the TP/ETP-split parameter and the writer
turns the shards into its checkpoint tensors (`mapping.from_shards`, then the family's
`export_pieces`: whole tensors, or an EP rank's experts' rows of a fused GPT-OSS tensor).

Returns this rank's pieces: (checkpoint name, first row or None for a whole tensor, tensor, order),
where `order` = (stage, parameter index, output index) is the tensor's place in `model.gather`'s stream.
The tensors are a snapshot: they never share memory with a parameter (the next step may change those
while the pieces are still being written), so they cost, on this rank, about its share of the model in
the model's dtype (`memory.publish_snapshot_bytes`).
"""

from __future__ import annotations

import torch

from offpolicy.backends.megatron import families, mapping
from offpolicy.backends.megatron.arch import Arch
from offpolicy.backends.megatron.model import group_shards, named

Piece = tuple[str, "int | None", torch.Tensor, tuple[int, ...]]


def local_pieces(model, arch: Arch, par, *, te: bool, grouped: bool = True) -> list[Piece]:
    params = named(model)
    family = families.get(arch.model_type)
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    # bytes given so far to each (replica, group member), per kind: dense (dp x tp), expert (edp x etp); on
    # several nodes only replica 0 writes (each node's store then holds what it always held: see module doc)
    one_node = len(set(par.node_of)) == 1
    dp, edp = (par.dp, par.edp) if one_node else (1, 1)
    loads = {"dense": [[0] * par.tp for _ in range(dp)], "expert": [[0] * par.etp for _ in range(edp)]}
    out: list[Piece] = []
    for i, p in enumerate(families.stage_params(arch, par.pp_rank, par.pp, te=te, ep=par.ep, grouped=grouped)):
        if not p.export:
            continue
        if p.ep_rank is None:
            mine, size, group, me, replica, kind = True, par.tp, par.tp_group, par.tp_rank, par.dp_rank, "dense"
        else:
            mine, size, group, me, replica, kind = (par.ep_rank == p.ep_rank, par.etp, par.etp_group, par.etp_rank,
                                                    par.edp_rank, "expert")
        if not mine:
            continue
        load = loads[kind]
        width = params[p.name].numel() * params[p.name].element_size() * (1 if p.kind == "rep" else size)
        chosen, writer = min(((d, r) for d in range(len(load)) for r in range(size)), key=lambda dr: (load[dr[0]][dr[1]], dr))
        load[chosen][writer] += width
        if replica != chosen:
            continue
        shards = group_shards(p, params[p.name].detach(), size, group)
        if me != writer:
            continue
        hf = mapping.from_shards(p, shards, arch)
        for j, (name, row, t) in enumerate(family.export_pieces(arch, hf)):
            t = t.contiguous()
            if t.untyped_storage().data_ptr() in storages:  # a view of the parameter itself: snapshot it
                t = t.clone()
            out.append((name, row, t, (par.pp_rank, i, j)))
    return out
