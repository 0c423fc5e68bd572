"""This rank's share of a weight version, for the sharded publish (offpolicy/weights/sharded.py).

`local_pieces(model, arch, par, te=..., grouped=...)` is a collective of every rank, run in step like
`model.gather`, but nothing leaves the group that holds a parameter: a stage's parameters are held by
every data-parallel replica's TP group (experts: every expert-data-parallel replica's ETP group of their
EP rank), identical after each step. Each parameter goes to one replica and one member of its group, its
writer, chosen by bytes, greedily (to the (replica, member) with the fewest bytes so far, ties to the
lowest), so the replicas and the ranks of a group write about equal shares (under EP2 on 2 GPUs both
ranks write half the dense tensors, not rank 0 all of them); every rank computes the same choice from
the shard shapes it holds. A learner on several nodes keeps replica 0 as the only writer (its nodes'
stores then hold the parts they always held, and a fused tensor's rows stay on one node). A parameter
that TP splits by rows of its HF tensors (QKV, the dense fc1, the vocabulary, per-head sinks:
`mapping.ROW_KINDS`) is written by every rank of one replica's TP group, each its own rows
(`mapping.own_rows`: no gather; not where the TP group spans machines, or fp8 scale blocks would
straddle two ranks' rows). Other split parameters (row-parallel: attention output, fc2; experts
under ETP) are all-gathered inside the group and the writer turns the shards into its checkpoint tensors
(`mapping.from_shards`, then the family's `export_pieces`: whole tensors, or an EP rank's experts' rows of
a fused GPT-OSS tensor).

Returns this rank's pieces: (checkpoint name, first row or None for a whole tensor, tensor, order),
where `order` = (stage, parameter index, output index) is the tensor's place in `model.gather`'s stream.
The tensors are a snapshot: they never share memory with a parameter (the next step may change those
while the pieces are still being written), so they cost, on this rank, about its share of the model in
the model's dtype (`memory.publish_snapshot_bytes`).
"""

from __future__ import annotations

import torch

from offpolicy.learner.backends.megatron import families, mapping
from offpolicy.learner.backends.megatron.arch import Arch
from offpolicy.learner.backends.megatron.model import group_shards, named

Piece = tuple[str, "int | None", torch.Tensor, tuple[int, ...]]


def local_pieces(model, arch: Arch, par, *, te: bool, grouped: bool = True, fp8_rows: int = 0,
                 fp8_skip: tuple[str, ...] = ()) -> list[Piece]:
    """This rank's pieces (see the module doc). `fp8_rows` (> 0 when the run also publishes fp8: its block's
    rows) and `fp8_skip` (weights.fp8_skip) keep a TP rank's own rows to those an fp8 scale block can start."""
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
        local = params[p.name].detach()
        if _rows_of_each_rank(p, local, arch, par, family, size, fp8_rows, fp8_skip):
            # every rank of one replica's TP group writes its own rows of the HF tensors: no gather
            chosen = min(range(len(load)), key=lambda d: (sum(load[d]), d))
            load[chosen] = [b + width // size for b in load[chosen]]
            if replica == chosen:
                for j, (name, row, t) in enumerate(mapping.own_rows(p, local, arch, me, size)):
                    out.append((name, row, _snapshot(t, storages), (par.pp_rank, i, j)))
            continue
        chosen, writer = min(((d, r) for d in range(len(load)) for r in range(size)), key=lambda dr: (load[dr[0]][dr[1]], dr))
        load[chosen][writer] += width
        if replica != chosen:
            continue
        shards = group_shards(p, local, size, group)
        if me != writer:
            continue
        hf = mapping.from_shards(p, shards, arch)
        for j, (name, row, t) in enumerate(family.export_pieces(arch, hf)):
            out.append((name, row, _snapshot(t, storages), (par.pp_rank, i, j)))
    return out


def _snapshot(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """`t` in memory of its own: a copy where it is a view of a parameter (the next step changes those)."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().data_ptr() in storages else t


def _rows_of_each_rank(p, local: torch.Tensor, arch: Arch, par, family, size: int, fp8_rows: int,
                       fp8_skip: tuple[str, ...]) -> bool:
    """Whether each TP rank writes its own rows of `p`'s HF tensors (`mapping.own_rows`) instead of the group
    gathering them to one writer: a dense parameter split by rows of tensors the checkpoint stores as they
    are, a TP group on one machine (each file stays on one node), and, with fp8, rows that start on a
    scale block (the same answer on every rank: the shards' shapes are equal)."""
    if size == 1 or p.ep_rank is not None or p.stack or p.kind not in mapping.ROW_KINDS or not par.tp_one_node:
        return False
    if not all(family.as_is(n) for n in p.hf):
        return False
    if fp8_rows:
        from offpolicy.weights import fp8

        for name, n in zip(p.hf, mapping.row_counts(p, local, arch, size)):  # a piece has its shard's dims
            if n % fp8_rows and fp8.quantizable(name, local, fp8_skip):
                return False
    return True
