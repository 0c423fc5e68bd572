"""HF <-> Megatron-core parameter mapping, TP- and EP-aware; the layer specifics come from the families.

A `Param` is one Megatron parameter with its `kind` and the HF tensors it is made of
(`families.stage_params` lists a pipeline stage's: the embedding, final norm and output layer, and each
decoder layer from its family's `layer_params`, built from `attention_params` and `expert_params` here);
expert parameters carry the expert-parallel rank that holds them (`ep_rank`), the others `None`. `to_shard` builds one
tensor-parallel rank's shard from full HF tensors (for expert parameters: one expert-tensor-parallel
rank's); `from_shards` turns the list of all (E)TP ranks' shards back into full HF tensors.
Layouts (Megatron's, which this module reproduces without sharing code with it):
- qkv:  rows ordered per query group g: [q heads of g (heads/groups x head_dim), k_g, v_g]; TP rank r
        holds the groups r*G/tp .. (r+1)*G/tp - 1, so concatenating the shards gives the full tensor.
- fc1:  each TP rank holds [gate_r; up_r] (its rows of gate_proj, then of up_proj; biases alike).
- vocab: embedding / output rows padded with zeros to `arch.padded_vocab(tp)`, split by rows.
- row:  split by columns (attention output, fc2); `rep`: replicated (norms, row-parallel biases, router).
- col:  split by rows (per-head attention sinks: TP rank r holds its heads' sinks).
- MoE:  EP rank r holds experts r*E/ep .. (r+1)*E/ep - 1 (`expert_slots`), each with fc1 = [gate_r; up_r]
        and fc2 split like the dense MLP over the ETP ranks; grouped (experts.GroupedExperts, the default)
        stacked as `mlp.experts.linear_fc1.weight` [E/ep, ...] (a Param with `stack` = E/ep: its HF names
        are every local expert's in turn), sequential (SequentialMLP) as `mlp.experts.local_experts.<j>`,
        j = e - r*E/ep (`expert_params`).
HF names are those a family's reader serves (family.py); the checkpoint's may differ (fused experts).
Invariant: from_shards([to_shard(hf, r) for r in range(tp)]) == hf exactly, for every kind; and for the
kinds whose shards are rows of their HF tensors (`ROW_KINDS`), `own_rows` of each rank's shard puts those
same tensors together without any rank seeing another's shard (the sharded publish's TP path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from offpolicy.learner.backends.megatron.arch import Arch


@dataclass(frozen=True)
class Param:
    name: str  # Megatron name on this stage (decoder layers numbered locally)
    kind: str  # "qkv", "fc1", "vocab", "row", "col" or "rep"
    hf: tuple[str, ...]  # HF names it is built from (q, k, v for qkv; gate, up for fc1)
    export: bool = True  # False for the tied output-layer copy on the last stage
    ep_rank: int | None = None  # the expert-parallel rank holding this expert parameter; None = not an expert
    stack: int = 0  # > 0: `stack` experts' parameters of `kind` stacked on a first dimension (hf: theirs in turn)


def attention_params(arch: Arch, hf: str, mg: str, *, te: bool, mlp_norm_fused: bool) -> list[Param]:
    """A layer's two norms, QKV (biases, q/k norms), sinks and output projection, as `arch` has them."""
    attn = hf + "self_attn."
    ln_in = mg + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
    ln_mlp = mg + ("mlp.linear_fc1.layer_norm_weight" if mlp_norm_fused else "pre_mlp_layernorm.weight")
    out = [Param(ln_in, "rep", (hf + "input_layernorm.weight",))]
    for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
        out.append(Param(f"{mg}self_attention.linear_qkv.{kind}", "qkv", tuple(f"{attn}{p}_proj.{kind}" for p in "qkv")))
    if arch.qk_norm:
        out.append(Param(mg + "self_attention.q_layernorm.weight", "rep", (attn + "q_norm.weight",)))
        out.append(Param(mg + "self_attention.k_layernorm.weight", "rep", (attn + "k_norm.weight",)))
    if arch.attn_sinks:  # DotProductAttention's learnable softmax offset, one per (local) head
        out.append(Param(mg + "self_attention.core_attention.softmax_offset", "col", (attn + "sinks",)))
    out.append(Param(mg + "self_attention.linear_proj.weight", "row", (attn + "o_proj.weight",)))
    if arch.linear_bias:
        out.append(Param(mg + "self_attention.linear_proj.bias", "rep", (attn + "o_proj.bias",)))
    out.append(Param(ln_mlp, "rep", (hf + "post_attention_layernorm.weight",)))
    return out


def expert_slots(arch: Arch, ep: int) -> list[tuple[int, int, int]]:
    """(EP rank, local index, global expert) of every expert: EP rank r holds r*E/ep .. (r+1)*E/ep - 1."""
    per = arch.num_experts // ep
    return [(r, j, r * per + j) for r in range(ep) for j in range(per)]


def expert_params(arch: Arch, ep: int, hf: str, mg: str, pieces: list[tuple[str, str, tuple[str, ...]]], *,
                  grouped: bool) -> list[Param]:
    """The experts of one MoE layer: `hf` = "model.layers.<i>.mlp.experts.", `mg` = "decoder.layers.<j>.mlp.experts.",
    `pieces` = (Megatron suffix, kind, HF suffixes) of one expert, e.g. ("linear_fc1.weight", "fc1",
    ("gate_proj.weight", "up_proj.weight")); stacked per EP rank when `grouped`, else one set per expert."""
    if not grouped:
        return [Param(f"{mg}local_experts.{j}.{suffix}", kind, tuple(f"{hf}{e}.{n}" for n in names), ep_rank=r)
                for r, j, e in expert_slots(arch, ep) for suffix, kind, names in pieces]
    per = arch.num_experts // ep
    return [Param(mg + suffix, kind, tuple(f"{hf}{e}.{n}" for e in range(r * per, (r + 1) * per) for n in names),
                  ep_rank=r, stack=per) for r in range(ep) for suffix, kind, names in pieces]


def experts(p: Param) -> list[tuple[Param, slice]]:
    """A stacked `p` as one unstacked Param per expert, with the slice of `p.hf` it is made of."""
    n = len(p.hf) // p.stack
    return [(replace(p, hf=p.hf[i * n:(i + 1) * n], stack=0), slice(i * n, (i + 1) * n)) for i in range(p.stack)]


def to_shard(p: Param, hf: list[torch.Tensor], arch: Arch, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of Megatron parameter `p` from its full HF tensors `hf`."""
    if p.stack:
        return torch.stack([to_shard(one, hf[part], arch, tp_rank, tp) for one, part in experts(p)])
    if p.kind == "rep":
        return hf[0]
    if p.kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if p.kind == "col":
        return hf[0].chunk(tp, dim=0)[tp_rank]
    if p.kind == "vocab":
        w = hf[0]
        pad = arch.padded_vocab(tp) - w.shape[0]
        if pad:
            w = torch.cat([w, w.new_zeros((pad, *w.shape[1:]))])
        return w.chunk(tp, dim=0)[tp_rank]
    if p.kind == "fc1":
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up])
    if p.kind == "qkv":
        return _interleave(*hf, arch).chunk(tp, dim=0)[tp_rank]
    raise ValueError(f"unknown parameter kind {p.kind!r}")


def from_shards(p: Param, shards: list[torch.Tensor], arch: Arch) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors of `p` from every TP rank's shard (in TP rank order), in the order of `p.hf`."""
    if p.stack:
        return [t for i, (one, _) in enumerate(experts(p)) for t in from_shards(one, [s[i] for s in shards], arch)]
    if p.kind == "rep":
        return [(p.hf[0], shards[0])]
    if p.kind == "row":
        return [(p.hf[0], torch.cat(shards, dim=1))]
    if p.kind == "col":
        return [(p.hf[0], torch.cat(shards))]
    if p.kind == "vocab":
        return [(p.hf[0], torch.cat(shards)[: arch.vocab_size])]
    if p.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(p.hf[0], torch.cat([h[0] for h in halves])), (p.hf[1], torch.cat([h[1] for h in halves]))]
    if p.kind == "qkv":
        return list(zip(p.hf, _deinterleave(torch.cat(shards), arch)))
    raise ValueError(f"unknown parameter kind {p.kind!r}")


ROW_KINDS = ("col", "vocab", "fc1", "qkv")  # a TP rank's shard is rows of each of its HF tensors: `own_rows`


def row_counts(p: Param, shard: torch.Tensor, arch: Arch, tp: int) -> list[int]:
    """Rows of each of `p`'s HF tensors (in `p.hf` order) in one TP rank's `shard`, for a `ROW_KINDS` parameter:
    TP rank r's rows of tensor j start at r * row_counts[j] (every rank's shard has the same shape)."""
    if p.stack or p.kind not in ROW_KINDS:
        raise ValueError(f"{p.name}: a {'stacked ' if p.stack else ''}{p.kind!r} shard is not rows of its HF tensors")
    n = shard.shape[0]
    if p.kind in ("col", "vocab"):
        return [n]
    if p.kind == "fc1":
        return [n // 2, n // 2]
    groups = arch.num_query_groups // tp  # qkv: this rank's query groups, each [q heads; k; v]
    d = arch.head_dim
    return [groups * (arch.num_heads // arch.num_query_groups) * d, groups * d, groups * d]


def own_rows(p: Param, shard: torch.Tensor, arch: Arch, tp_rank: int, tp: int) -> list[tuple[str, int, torch.Tensor]]:
    """TP rank `tp_rank`'s `shard` of a `ROW_KINDS` parameter as rows of its HF tensors, (HF name, first row,
    rows), in the order `from_shards` gives the tensors; the rows of every rank, put in place, make
    `from_shards` of all the shards exactly (vocabulary padding rows are left out: a rank holding only
    padding gives no row of the embedding). No gather: the sharded publish writes each rank's rows."""
    counts = row_counts(p, shard, arch, tp)
    if p.kind == "col":
        return [(p.hf[0], tp_rank * counts[0], shard)]
    if p.kind == "vocab":
        first = tp_rank * counts[0]
        keep = max(0, min(counts[0], arch.vocab_size - first))
        return [(p.hf[0], first, shard[:keep])] if keep else []
    if p.kind == "fc1":
        gate, up = shard.chunk(2, dim=0)
        return [(p.hf[0], tp_rank * counts[0], gate), (p.hf[1], tp_rank * counts[1], up)]
    qkv = _deinterleave(shard, arch, groups=arch.num_query_groups // tp)  # this rank's query groups
    return [(name, tp_rank * n, t) for name, n, t in zip(p.hf, counts, qkv)]


def _interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Arch) -> torch.Tensor:
    g, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _deinterleave(qkv: torch.Tensor, arch: Arch, groups: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) rows of fused QKV rows holding `groups` query groups (default: all of them)."""
    g, d = groups or arch.num_query_groups, arch.head_dim
    per_group = arch.num_heads // arch.num_query_groups * d  # q rows of one group
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
