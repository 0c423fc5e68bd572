"""MXFP4 GPT-OSS versions loaded into a running vLLM server in place (the worker's `offpolicy_load`, worker.py), where
vLLM's own in-place reload cannot take them and each used to be a rebuild.

vLLM 0.26's Triton MXFP4 MoE on Hopper keeps the experts in triton_kernels wrappers once loaded
(`fused_moe/oracle/mxfp4.py` 1135-1175, `quantization/mxfp4.py` 343-364): the values as the `RoutedExperts` layer's
`w13_weight` / `w2_weight` (wrappers, not Parameters), the scales in its quant method's precision configs
(`w13_precision_config.weight_scale`; the scale Parameters deleted), the biases as float32 `w13_bias` / `w2_bias`.
Its reload_weights raises on such a layer (`attribute 'w13_weight' already exists`), so a rebuild (a fresh model built
by vLLM's start-up path, its tensors copied in: adopt.py) sat on the rollout's critical path every version (measured:
docs/vllm.md, "MXFP4 experts in place"). Here instead:
- each expert tensor goes into the running wrapper through its own layout (`mxfp4_kernels.into_wrapper`: transposed,
  the scales zero-padded as vLLM pads them, swizzled, copied into the storage), each bias into the float32 Parameter;
- every other tensor (attention, router, sinks, norms, embeddings) through the model's own `load_weights` (vLLM's
  start-up path, its weight loaders copying into the running parameters; unquantized layers have nothing to process
  after loading on a GPU).
The tensors stream through once (a window at a time where the load reads the files directly). On a server that shards
the experts over its workers (TP, DP or EP: `sharded`), each worker writes its own part, cut as vLLM's loader cut the
first version (`mxfp4_kernels.Shard`, from the layer's MoE parallel config) and zero-padded to what the layer holds
(`as_held`); a server whose shards are unknown (`uncut`) or whose experts are kept in other wrappers (`writable`)
rebuilds every load; what cannot be written all the same (shapes that differ) is returned, and the worker then
rebuilds (the rebuild overwrites what was written). Imports torch and offpolicy only: tested with stand-in wrappers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from offpolicy.rollout.engines.fingerprint import owned
from offpolicy.rollout.engines.mxfp4_kernels import (WHOLE, Shard, as_held, expert_part, into_bias, into_wrapper,
                                                     swizzled_for)


def routed(module: torch.nn.Module) -> torch.nn.Module | None:
    """The layer holding a checkpoint experts module's kernel wrappers: the module itself or one of its children
    (vLLM 0.26's `FusedMoE.routed_experts`); None where neither holds them."""
    for m in (module, *module.children()):
        if _wrappers(m) is not None:
            return m
    return None


def _wrappers(m: torch.nn.Module) -> dict[tuple[str, str], object] | None:
    """(projection, part) -> the triton_kernels wrapper holding it, for a vLLM Triton MXFP4 experts layer; None where
    `m` is not one (any of the four missing, or without a layout)."""
    qm = getattr(m, "quant_method", None)
    found = {}
    for proj in ("w13", "w2"):
        found[proj, "value"] = m.__dict__.get(f"{proj}_weight")
        found[proj, "scale"] = getattr(getattr(qm, f"{proj}_precision_config", None), "weight_scale", None)
    ok = all(getattr(getattr(w, "storage", None), "layout", None) is not None for w in found.values())
    return found if ok else None


def writable(model: torch.nn.Module) -> str | None:
    """Why this model's kernel-wrapped weights cannot be loaded here (None: they can): every module holding a kernel
    wrapper must be a Triton MXFP4 experts layer (`_wrappers`)."""
    for name, module in model.named_modules():
        wrapped = any(n.endswith(".storage") for n, _, _, _ in owned(module))
        if wrapped and _wrappers(module) is None:
            return f"{name or 'the model'} keeps kernel-wrapped weights offpolicy's MXFP4 load does not know"
    return None


def sharded(parallel_config: object) -> str | None:
    """How a server's experts are sharded (None: each worker holds them whole): tensor or data parallelism over its
    workers (vLLM cuts the experts' intermediate dimension across TP x DP ranks where expert parallelism is off) or
    expert parallelism."""
    tp, dp = (int(getattr(parallel_config, k, 1) or 1) for k in ("tensor_parallel_size", "data_parallel_size"))
    if getattr(parallel_config, "enable_expert_parallel", False):
        return "expert parallelism (enable_expert_parallel)"
    return f"{tp * dp} ranks (tensor_parallel_size {tp} x data_parallel_size {dp})" if tp * dp > 1 else None


def shard_of(layer: torch.nn.Module) -> Shard | None:
    """The Shard of a Triton MXFP4 experts layer (its `moe_config.moe_parallel_config`: with expert parallelism TP 1
    and EP over TP x DP, else TP flattened over DP and EP 1, as vLLM's loader cuts); None where it says none, or its
    expert-parallel load balancer may move experts between ranks (eplb)."""
    pc = getattr(getattr(layer, "moe_config", None), "moe_parallel_config", None)
    if pc is None or getattr(pc, "enable_eplb", False):
        return None
    return Shard(int(pc.tp_size), int(pc.tp_rank), int(pc.ep_size), int(pc.ep_rank))


def uncut(model: torch.nn.Module, parallel_config: object) -> str | None:
    """Why the experts of a server that shards them (`sharded`) cannot be cut here as vLLM cut them (None: they can,
    or are whole): a Triton MXFP4 experts layer whose Shard is unknown (`shard_of`)."""
    how = sharded(parallel_config)
    if how is None:
        return None
    for name, module in model.named_modules():
        if _wrappers(module) is not None and shard_of(module) is None:
            return f"{how}, and {name} does not say how vLLM cut its experts (or balances them over ranks: eplb)"
    return None


def write(layer: torch.nn.Module | None, proj: str, part: str, t: torch.Tensor, shard: Shard = WHOLE,
          swizzled: torch.Tensor | None = None) -> str | None:
    """One part of one projection into the running experts layer (`routed`'s; None: there is none), this worker's
    part of it (`shard`) as the layer holds it, or `swizzled`, what `prepare` made of it ahead; why not (None when
    written)."""
    if layer is None:
        return "no Triton MXFP4 experts layer here"
    if swizzled is None:
        t = as_held(layer._parameters.get("w13_bias"), proj, part, t, shard)
    if part == "bias":
        return into_bias(layer._parameters.get(f"{proj}_bias"), t, f"{proj}_bias")
    why = into_wrapper(_wrappers(layer)[proj, part], part, t, swizzled)
    return None if why is None else f"{proj} {why}"


class _Layers:
    """The checkpoint's experts module -> the layer holding its kernels and this worker's part of them, looked up once
    a module."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.found = model, {}

    def __call__(self, module: str) -> tuple[torch.nn.Module | None, Shard]:
        if module not in self.found:
            layer = routed(self.model.get_submodule(module))
            self.found[module] = layer, shard_of(layer) or WHOLE
        return self.found[module]


def prepared_bytes(model: torch.nn.Module) -> int:
    """Bytes `prepare` makes of a version: what the model's MXFP4 experts' wrappers hold (values and scales)."""
    return sum(int(w.storage.data.nbytes) for m in model.modules() if (found := _wrappers(m)) is not None
               for w in found.values())


def prepare(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The experts' values and scales of a version's checkpoint tensors `named` as the running wrappers hold them
    (this worker's part, swizzled: `mxfp4_kernels.swizzled_for`), by checkpoint name: what a staging makes of them in
    the background, so that the load (`load(..., prepared)`) only copies them into the wrappers' storage. Reads the
    model, writes nothing of it; what cannot be prepared is left out (the load then says why)."""
    layers, out = _Layers(model), {}
    for name, t in named:
        where = expert_part(name)
        if where is None or where[2] == "bias":
            continue
        module, proj, part = where
        layer, shard = layers(module)
        if layer is None:
            continue
        held = as_held(layer._parameters.get("w13_bias"), proj, part, t, shard)
        swizzled, _ = swizzled_for(_wrappers(layer)[proj, part], part, held)
        if swizzled is not None:
            out[name] = swizzled
    return out


def load(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]],
         prepared: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Load a version's checkpoint tensors `named` (HF names) into the running `model`: the experts into their
    kernels' storage (from `prepared`, `prepare`'s of the same version, where it has them), the rest by
    `model.load_weights`, in one pass; what could not be written ("module: why")."""
    refused: list[str] = []
    layers, prepared = _Layers(model), prepared or {}

    def rest() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            where = expert_part(name)
            if where is None:
                yield name, t
                continue
            module, proj, part = where
            layer, shard = layers(module)
            why = write(layer, proj, part, t, shard, prepared.get(name))
            if why is not None:
                refused.append(f"{module}: {why}")

    model.load_weights(rest())
    return refused
