"""The Megatron GPTModel of one pipeline stage: build, load HF weights into it, gather them back.

`build` makes the stage's `GPTModel` with the Transformer-Engine layer spec when TE imports and
`megatron.transformer_impl` allows it, else the local (pure megatron-core) spec with its torch norms
replaced by `norms.Norm` (correct under sequence parallelism), its core attention by
`attention.CoreAttention` (flash kernels, padded or packed rows; sliding windows and learnable sinks
from the config), its self-attention by `qkv.FusedSelfAttention` (the q/k/v split, head norms and RoPE in one
Triton pass each way where it runs) and, for families with expert biases, `expert_linear.ExpertRowParallelLinear`. Its
rotary embedding (plain RoPE or YaRN) is wrapped in `PositionedRotary`, so that
`hidden_states(model, positions)` can run the stage at per-token positions (packed rows restart at 0)
and return the final hidden states instead of logits (the loss applies the output weight,
`head_weight`, in vocabulary chunks). `load` copies this rank's shard of every parameter from an
`source.HFSource` through the family's reader (mapping.to_shard; experts: only this EP rank's, split
over the ETP ranks). `gather` is a collective: every rank calls it in step; it yields full HF-named
tensors on global rank 0 only, one tensor at a time (the owning stage's TP ranks, or for an expert
its EP rank's ETP ranks, all-gather their shards, and the owner sends the merged tensors to rank 0),
so no rank ever holds more than one full tensor beyond its own shards (a family whose checkpoint
fuses a layer's experts, GPT-OSS, holds that fused tensor until its last expert arrives). MoE models
use Megatron's per-layer block spec (dense and MoE layers per `moe_layer_freq`); on the local spec their
experts are `experts.GroupedExperts` (stacked weights, grouped GEMMs; `grouped`, the default) or
megatron-core's SequentialMLP (`grouped=False`, learner.megatron.experts=sequential).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from offpolicy.learner.backends.megatron import families, mapping
from offpolicy.learner.backends.megatron.arch import Arch, ArchError, rope_kwargs
from offpolicy.learner.backends.megatron.kernels import norms
from offpolicy.learner.backends.megatron.kernels.compiled import tokens_dynamic
from offpolicy.learner.backends.megatron.kernels.rope import tables as _tables
from offpolicy.learner.backends.megatron.source import HFSource


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def use_te(arch: Arch, impl: str, packing: bool = False) -> bool:
    """Whether to build TE's layer spec under learner.megatron.transformer_impl `impl` (`auto` with
    packed micro-batches: the local spec, whose core attention runs them)."""
    te_ok = families.get(arch.model_type).te
    if impl == "transformer_engine" and not te_ok:
        raise ArchError(f"learner.megatron.transformer_impl=transformer_engine: config.json model_type "
                        f"{arch.model_type} builds only the local spec here; set it to local or auto")
    return te_ok and (impl == "transformer_engine" or (impl == "auto" and not packing and te_available()))


def grouped_experts(experts: str, te: bool) -> bool:
    """Whether the MoE experts are experts.GroupedExperts: learner.megatron.experts `experts` on the local spec
    (the TE spec keeps its own SequentialMLP, and the mapping its per-expert names)."""
    return experts == "grouped" and not te


def build(arch: Arch, tconfig, *, pre: bool, post: bool, use_te: bool, grouped: bool = True):
    """This stage's GPTModel (parameters uninitialised: `load` fills them); MoE experts of the local spec
    stacked (`grouped`: experts.GroupedExperts) or megatron-core's SequentialMLP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if arch.is_moe:  # per-layer specs: the MoE block where tconfig.moe_layer_freq says so, else the dense MLP
        spec = specs.get_gpt_decoder_block_spec(tconfig, use_transformer_engine=use_te, normalization="RMSNorm")
    elif use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:  # a block spec, so that the final layernorm is ours too
        from megatron.core.transformer.transformer_block import get_num_layers_to_build

        spec = norms.block_spec(specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm),
                                get_num_layers_to_build(tconfig))
        if tconfig.use_te_activation_func:  # arch.transformer_config(swiglu_module=True)
            from offpolicy.learner.backends.megatron.kernels.glu import with_swiglu

            spec = with_swiglu(spec)
    if not use_te:  # torch norms refuse sequence parallel; ours mark their weights for the TP grad all-reduce
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from megatron.core.transformer.attention import SelfAttention

        from offpolicy.learner.backends.megatron.kernels.attention import CoreAttention
        from offpolicy.learner.backends.megatron.kernels.qkv import FusedSelfAttention

        spec = norms.swap_modules(norms.with_norms(spec), {DotProductAttention: CoreAttention,
                                                           SelfAttention: FusedSelfAttention})
    if not use_te and arch.is_moe and arch.linear_bias:  # expert biases: see expert_linear.py
        from megatron.core.tensor_parallel import RowParallelLinear

        from offpolicy.learner.backends.megatron.kernels.expert_linear import ExpertRowParallelLinear

        spec = norms.swap_modules(spec, {RowParallelLinear: ExpertRowParallelLinear})
    if not use_te and arch.is_moe and grouped:
        from megatron.core.transformer.moe.experts import SequentialMLP

        from offpolicy.learner.backends.megatron.kernels.experts import GroupedExperts

        spec = norms.swap_modules(spec, {SequentialMLP: GroupedExperts})
    model = GPTModel(tconfig, spec, vocab_size=arch.padded_vocab(tconfig.tensor_model_parallel_size),
                     max_sequence_length=arch.max_positions, pre_process=pre, post_process=post,
                     parallel_output=True, share_embeddings_and_output_weights=arch.tie_embeddings,
                     **rope_kwargs(arch))
    _mark_experts(model, tconfig)
    _mark_sinks(model)
    if getattr(model, "rotary_pos_emb", None) is not None:
        model.rotary_pos_emb = PositionedRotary(model.rotary_pos_emb)
    return model


class PositionedRotary(torch.nn.Module):
    """megatron-core's rotary embedding (`inner`), read at given per-token positions while `at` is set.

    GPTModel asks it for a table of the first `seq_len` positions `[s, 1, 1, d]` (YaRN: with its
    mscale); with `at = (positions [T], table length)` it answers that table's rows at `positions`
    instead, which megatron's sbhd RoPE then applies token by token."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.at: tuple[torch.Tensor, int] | None = None

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, seq_len, *args, **kwargs):
        if self.at is None:
            return self.inner(seq_len, *args, **kwargs)
        positions, table = self.at
        out = self.inner(table, *args, **kwargs)
        return (out[0][positions], *out[1:]) if isinstance(out, tuple) else out[positions]


def gpt(model):
    """The GPTModel inside a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


@contextmanager
def hidden_states(model, positions: torch.Tensor | None = None, table: int = 0):
    """Within: `model(...)` returns the final (normed) hidden states `[s, b, h]` instead of logits, and
    with `positions` `[T]` RoPE reads positions [0, table) at those per-token positions."""
    inner = gpt(model)
    post, inner.post_process = inner.post_process, False
    rotary = getattr(inner, "rotary_pos_emb", None)
    if positions is not None:
        if not isinstance(rotary, PositionedRotary):
            raise RuntimeError("per-token positions need the rotary embedding of model.build (PositionedRotary)")
        rotary.at = (positions, table)
    try:
        yield
    finally:
        inner.post_process = post
        if isinstance(rotary, PositionedRotary):
            rotary.at = None


_ROPE: dict[str, object] = {}


def compile_rope() -> None:
    """Run megatron-core's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`, which
    `apply_rotary_pos_emb` looks up at each call) as one compiled kernel each way over t, with the rotation's
    cos and sin tables computed first, once per token (`_rope`): megatron's function takes the angles
    `freqs` [s, 1, 1, d] and computes `cos(freqs) * mscale` and `sin(freqs) * mscale` inside, which compiled
    into every element of t: 64 heads' worth of transcendentals per table entry for GPT-OSS's q (its kernels
    took well over their memory traffic's time; docs/benchmarks.md). The tables
    are rounded to t's dtype as megatron's are, and the rotation is megatron's `_rotate_half`. Only the
    sequence dim of t `[s, b, heads, d]` and of the tables is symbolic (marked at each call; a graph each for
    q's and k's head counts): with every size symbolic (dynamic=True, as before) the rotary width and
    rotate_half's halves were indexed through symbolic divisions, and the kernels ran several times slower than
    their memory traffic (docs/benchmarks.md). Multi-latent attention's interleaving goes to megatron's function
    (compiled as it is). Process-wide and idempotent; GPU only."""
    import inspect

    from megatron.core.models.common.embeddings import rope_utils

    if "plain" not in _ROPE:
        plain = rope_utils._apply_rotary_pos_emb_bshd
        _ROPE.update(plain=plain, compiled=torch.compile(plain), signature=inspect.signature(plain),
                     rotate=torch.compile(_rotate))
        rope_utils._apply_rotary_pos_emb_bshd = _rope


def _rotate(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """megatron's RoPE of t by tables `cos_`, `sin_` [s, 1, 1, d] (already times mscale, in t's dtype)."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    rot = cos_.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    return torch.cat(((x * cos_) + (_rotate_half(x, interleaved) * sin_), rest), dim=-1)


def _rope(t: torch.Tensor, freqs: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`_apply_rotary_pos_emb_bshd` by `_rotate` with the tables made once per token (`compile_rope`)."""
    bound = _ROPE["signature"].bind(t, freqs, *args, **kwargs)
    bound.apply_defaults()
    arg = bound.arguments
    if arg.get("multi_latent_attention") or arg.get("mla_rotary_interleaved"):
        tokens_dynamic(_ROPE, (t, 0), (freqs, 0))
        return _ROPE["compiled"](t, freqs, *args, **kwargs)
    cos_, sin_ = _tables(freqs, arg.get("mscale", 1.0), t.dtype)
    tokens_dynamic(_ROPE, (t, 0), (cos_, 0), (sin_, 0))
    return _ROPE["rotate"](t, cos_, sin_, bool(arg.get("rotary_interleaved", False)))


def head_weight(model) -> torch.Tensor:
    """The output layer's weight `[V/tp, h]` of the last stage (the embedding when they are tied)."""
    inner = gpt(model)
    if inner.share_embeddings_and_output_weights:
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


def _mark_experts(model, tconfig) -> None:
    """Put the experts' weights on Megatron's expert groups whenever those differ from the dense ones.

    DDP and the optimizer reduce a parameter over the expert-data-parallel group only when its
    `allreduce` attribute is False. megatron-core 0.16's local linears set it False only with ep > 1, so
    with ep = 1 and etp != tp (e.g. tp 2, etp 1) the experts' partial gradients (each TP rank routes its
    own sequence shard under SP) would be reduced over the dense data-parallel group instead, which
    misses the other TP ranks. 0.19 applies this same rule itself. Expert biases (GPT-OSS) also lose the
    `sequence_parallel` mark megatron-core 0.16-0.19 give every row-parallel bias: their gradients are
    summed over the expert-data-parallel group (which holds the TP ranks at etp 1), and finalize_model_grads
    would sum them over the TP ranks a second time. And at etp 1 an expert parameter is never a TP
    duplicate: megatron-core 0.16 filters the grad norm of expert parameters by the dense TP rank
    (0.19 by the expert TP rank), so with tp > 1 the row-parallel fc2 bias, which has no
    `tensor_model_parallel` mark, counted on TP rank 0 only (its distributed-optimizer shards on the
    other TP ranks were left out); it gets the mark."""
    if tconfig.num_moe_experts is None:
        return
    regroup = tconfig.expert_model_parallel_size > 1 or \
        tconfig.expert_tensor_parallel_size != tconfig.tensor_model_parallel_size
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.sequence_parallel = False
            if regroup:
                p.allreduce = False
            if tconfig.expert_tensor_parallel_size == 1 and not getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1


def _mark_sinks(model) -> None:
    """Mark the attention sinks (DotProductAttention's learnable `softmax_offset`, one per local head) as
    split over the TP ranks. megatron-core 0.16-0.19 do not, so the grad norm and the distributed
    optimizer would count only TP rank 0's sinks (`param_is_not_tensor_parallel_duplicate`)."""
    for name, p in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1


def named(model) -> dict[str, torch.nn.Parameter]:
    """Parameters by Megatron name, without a DDP wrapper's `module.` prefix."""
    inner = getattr(model, "module", model)
    return dict(inner.named_parameters())


def load(model, arch: Arch, source: HFSource, *, tp_rank: int, tp: int, pp_rank: int, pp: int, te: bool,
         ep_rank: int = 0, ep: int = 1, etp_rank: int = 0, etp: int = 1, grouped: bool = True) -> None:
    """Fill this rank's parameters from `source` (on the rank's device): only this stage's tensors and this
    EP rank's experts are asked for; a stacked expert parameter is filled one expert at a time."""
    params = named(model)
    get = families.get(arch.model_type).reader(arch, source)
    spec = [p for p in families.stage_params(arch, pp_rank, pp, te=te, ep=ep, grouped=grouped)
            if p.ep_rank in (None, ep_rank)]
    missing = set(params) - {p.name for p in spec}
    if missing:
        raise RuntimeError(f"no HF mapping for Megatron parameters {sorted(missing)}")
    with torch.no_grad():
        for p in spec:
            rank, size = (tp_rank, tp) if p.ep_rank is None else (etp_rank, etp)
            target = params[p.name]
            parts = mapping.experts(p) if p.stack else [(p, slice(None))]
            if p.stack and target.shape[0] != len(parts):
                raise RuntimeError(f"{p.name}: HF gives {len(parts)} experts, the model has {target.shape[0]}")
            for i, (one, _) in enumerate(parts):
                shard = mapping.to_shard(one, [get(n) for n in one.hf], arch, rank, size)
                into = target[i] if p.stack else target
                if tuple(shard.shape) != tuple(into.shape):
                    raise RuntimeError(f"{p.name}: HF gives {tuple(shard.shape)}, the model has {tuple(into.shape)}")
                into.copy_(shard)


def gather(model, arch: Arch, par, *, te: bool, grouped: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors on rank 0 (on CPU), in the checkpoint's layout (the family's export); a collective
    that every rank runs to the end."""
    return families.get(arch.model_type).export(arch, _gather(model, arch, par, te=te, grouped=grouped))


def _gather(model, arch: Arch, par, *, te: bool, grouped: bool) -> Iterator[tuple[str, torch.Tensor]]:
    params = named(model)
    for stage in range(par.pp):
        for p in families.stage_params(arch, stage, par.pp, te=te, ep=par.ep, grouped=grouped):
            if not p.export:
                continue
            if p.ep_rank is None:  # held by this stage's TP group of data-parallel rank 0
                holds, size, group = par.dp_rank == 0, par.tp, par.tp_group
                is_sender = holds and par.tp_rank == 0
            else:  # held by EP rank p.ep_rank's ETP group of expert-data-parallel rank 0
                holds, size, group = par.ep_rank == p.ep_rank and par.edp_rank == 0, par.etp, par.etp_group
                is_sender = holds and par.etp_rank == 0
            full: list[tuple[str, torch.Tensor]] = []
            if stage == par.pp_rank and holds:
                shards = group_shards(p, params[p.name].detach(), size, group)
                if is_sender:
                    full = mapping.from_shards(p, shards, arch)
            src = par.owner(stage, p.ep_rank)
            if src == 0:
                if par.rank == 0:
                    yield from ((n, t.cpu()) for n, t in full)
                continue
            if par.rank == src:
                for _, t in full:
                    _send(t.contiguous(), 0, par.device)
            elif par.rank == 0:
                for name in p.hf:  # from_shards gives one tensor per HF name, in order
                    yield name, _recv(src, par.device, params_dtype(model))


def group_shards(p, local: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every (E)TP rank's shard of parameter `p` (a collective of `group`, `size` ranks; a replicated
    parameter is this rank's own `size` times)."""
    if p.kind == "rep" or size == 1:
        return [local] * size
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def params_dtype(model) -> torch.dtype:
    return next(iter(named(model).values())).dtype


def _send(t: torch.Tensor, dst: int, device: torch.device) -> None:
    header = torch.zeros(5, dtype=torch.long, device=device)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.long)
    dist.send(header, dst)
    dist.send(t.to(device), dst)


def _recv(src: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    header = torch.zeros(5, dtype=torch.long, device=device)
    dist.recv(header, src)
    shape = header[1:1 + int(header[0])].tolist()
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t.cpu()
