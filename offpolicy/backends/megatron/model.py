"""The Megatron GPTModel of one pipeline stage: build, load HF weights into it, gather them back.

`build` makes the stage's `GPTModel` with the Transformer-Engine layer spec when TE imports and
`megatron.transformer_impl` allows it, else the local (pure megatron-core) spec. `HFSource` reads
full HF tensors by name, lazily from a safetensors directory or from an in-memory state dict.
`load` copies this rank's shard of every parameter (mapping.to_shard). `gather` is a collective:
every rank calls it in step; it yields full HF-named tensors on global rank 0 only, one tensor at a
time (the owning stage's TP ranks all-gather their shards, its TP rank 0 sends the merged tensors
to rank 0), so no rank ever holds more than one full tensor beyond its own shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from offpolicy.backends.megatron import mapping
from offpolicy.backends.megatron.arch import Arch


class HFSource:
    """Full HF tensors by name: from a safetensors directory (lazily) or a state dict."""

    def __init__(self, path: str | None = None, state: dict[str, torch.Tensor] | None = None):
        self.state, self.files = state, {}
        if path is not None:
            root = Path(path)
            index = root / "model.safetensors.index.json"
            if index.exists():
                self.files = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
            else:
                from safetensors import safe_open

                single = root / "model.safetensors"
                with safe_open(str(single), "pt") as f:
                    self.files = {k: single for k in f.keys()}

    def get(self, name: str) -> torch.Tensor:
        if self.state is not None:
            return self.state[name]
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"tensor {name} is not in the checkpoint: is model.path a supported HF model?")
        with safe_open(str(self.files[name]), "pt") as f:
            return f.get_tensor(name)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build(arch: Arch, tconfig, *, pre: bool, post: bool, use_te: bool):
    """This stage's GPTModel (parameters uninitialised: `load` fills them)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
    rope = dict(rope_scaling=arch.llama3_rope_factor is not None)
    if arch.llama3_rope_factor is not None:
        rope["rope_scaling_factor"] = arch.llama3_rope_factor
    return GPTModel(tconfig, spec, vocab_size=arch.padded_vocab(tconfig.tensor_model_parallel_size),
                    max_sequence_length=arch.max_positions, pre_process=pre, post_process=post,
                    parallel_output=True, share_embeddings_and_output_weights=arch.tie_embeddings,
                    position_embedding_type="rope", rotary_base=arch.rope_theta, **rope)


def named(model) -> dict[str, torch.nn.Parameter]:
    """Parameters by Megatron name, without a DDP wrapper's `module.` prefix."""
    inner = getattr(model, "module", model)
    return dict(inner.named_parameters())


def load(model, arch: Arch, source: HFSource, *, tp_rank: int, tp: int, pp_rank: int, pp: int, te: bool) -> None:
    params = named(model)
    spec = mapping.stage_params(arch, pp_rank, pp, te=te)
    missing = set(params) - {p.name for p in spec}
    if missing:
        raise RuntimeError(f"no HF mapping for Megatron parameters {sorted(missing)}")
    with torch.no_grad():
        for p in spec:
            shard = mapping.to_shard(p, [source.get(n) for n in p.hf], arch, tp_rank, tp)
            target = params[p.name]
            if tuple(shard.shape) != tuple(target.shape):
                raise RuntimeError(f"{p.name}: HF gives {tuple(shard.shape)}, the model has {tuple(target.shape)}")
            target.copy_(shard)


def gather(model, arch: Arch, par, *, te: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors on rank 0 (on CPU); a collective that every rank runs to the end."""
    params = named(model)
    is_sender = par.tp_rank == 0 and par.dp_rank == 0
    for stage in range(par.pp):
        for p in mapping.stage_params(arch, stage, par.pp, te=te):
            if not p.export:
                continue
            full: list[tuple[str, torch.Tensor]] = []
            if stage == par.pp_rank and par.dp_rank == 0:
                local = params[p.name].detach()
                if p.kind == "rep" or par.tp == 1:
                    shards = [local] * par.tp
                else:
                    shards = [torch.empty_like(local) for _ in range(par.tp)]
                    dist.all_gather(shards, local.contiguous(), group=par.tp_group)
                if is_sender:
                    full = mapping.from_shards(p, shards, arch)
            if stage == 0:
                if par.rank == 0:
                    yield from ((n, t.cpu()) for n, t in full)
                continue
            src = par.pipeline0[stage]
            if par.rank == src:
                for _, t in full:
                    _send(t.contiguous(), 0, par.device)
            elif par.rank == 0:
                for name in p.hf[: 2 if p.kind == "fc1" else 3 if p.kind == "qkv" else 1]:
                    yield name, _recv(src, par.device, params_dtype(model))


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
