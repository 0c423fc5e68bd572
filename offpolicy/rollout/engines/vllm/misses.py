"""What vLLM's in-place reload misses of a model type, loaded right after it: GPT-OSS's attention sinks and experts.

Why (vLLM 0.26 and 0.32 alike, docs/vllm.md "What vLLM's in-place reload misses"): `reload_weights` puts every
layer's tensors on the meta device and wraps their `weight_loader`s, runs the model's own `load_weights` over the
checkpoint, and processes each layer whose loaders were called into the running tensors' memory; a layer whose
loaders were never called gets its old tensors back ("Failed to load weights" in vLLM's log). GPT-OSS's
`load_weights` (the path of unquantized versions, `_load_weights_other`) copies the sinks (`param.data.copy_`) and the
experts' four tensors (`param.copy_`) straight into the parameters, past their loaders: into meta placeholders, which
keep nothing. So the sinks and the experts of every layer keep the old version's values.

What `reload_missed` does about it, one layer (`.layers.N.`) at a time: the missed parameters of the running modules
are swapped for zeroed ones of the same shape, the model's own `load_weights` loads that layer's missed checkpoint
tensors into them, each module's quant method processes them on a shadow of the module as vLLM's start-up load does
(its kernel set up afresh: vLLM 0.32 prepacks CPU experts only then, a weight update skips it), the running parameters
are put back, and the processed values are copied into them. The storages that vLLM's kernels, its CUDA graphs and
the fingerprint read stay the same; the running modules and their kernel objects are not touched otherwise.

The fingerprint is a multiset hash: it proves the values, not where they sit in a tensor (vLLM 0.32's CPU experts are
prepacked, a permutation, and hash like the checkpoint's). So `layout_holds` first checks the replay element by
element: on one layer, with the checkpoint the model holds, each replayed tensor must equal the running one that
vLLM's own load laid out. Where it does not (another kernel, another vLLM), the worker loads by rebuild instead.
Pure torch: the model and its modules are passed in, nothing here imports vLLM.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

Read = Callable[[Callable[[str], bool]], Iterable[tuple[str, torch.Tensor]]]  # (name, tensor) of the names kept


@dataclass(frozen=True)
class Misses:
    checkpoint: tuple[str, ...]  # name suffixes of the checkpoint tensors the reload does not load
    params: tuple[str, ...]  # the names of the parameters vLLM's modules hold them in

    def taken(self, name: str) -> bool:
        """Whether the reload loads the checkpoint tensor `name`: the ones it misses need not be handed to it (GPT-OSS's
        loader still slices and permutes each expert tensor it is given, on the tensor's device, for a copy into a
        meta placeholder: on the host, most of a load's time went there)."""
        return not name.endswith(self.checkpoint)


# Per HF model type. GPT-OSS (vllm/model_executor/models/gpt_oss.py, `_load_weights_other`): the sinks of each
# attention layer, and the fused gate-up / down weights and biases of each layer's experts (vLLM's w13 / w2).
RELOAD_MISSES = {"gpt_oss": Misses(
    checkpoint=(".sinks", ".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj",
                ".mlp.experts.down_proj_bias"),
    params=("sinks", "w13_weight", "w13_bias", "w2_weight", "w2_bias"))}

_LAYER = re.compile(r"\.layers\.(\d+)\.")
Holders = list[tuple[str, torch.nn.Module, list[str]]]  # (module name, module, its missed parameters' names)


def layer_of(name: str) -> int | None:
    m = _LAYER.search(f".{name}.")
    return int(m.group(1)) if m else None


def holders(model: torch.nn.Module, misses: Misses) -> dict[int | None, Holders]:
    """The modules that hold a missed parameter, by layer index (None: outside the layers)."""
    found: dict[int | None, Holders] = {}
    for name, module in model.named_modules():
        params = [p for p in misses.params if module._parameters.get(p) is not None]
        if params:
            found.setdefault(layer_of(name), []).append((name, module, params))
    return found


def _fresh(t: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(t), requires_grad=False)
    p.__dict__.update(t.__dict__)  # vLLM's attributes (weight_loader, ...)
    return p


def _shadow(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` whose parameters, buffers and submodules can be rebound without touching it."""
    s = copy.copy(module)
    s._parameters, s._buffers, s._modules = dict(module._parameters), dict(module._buffers), dict(module._modules)
    return s


def processed(module: torch.nn.Module, fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`fresh` (newly loaded values of some of `module`'s parameters) as `module`'s quant method lays them out at
    start-up: its `process_weights_after_loading` on a shadow of the module and of the method, the method's kernel
    unset (`moe_kernel`: vLLM then sets the kernel up and, on a CPU, prepacks the experts). A module without a quant
    method holds them as loaded."""
    method = getattr(module, "quant_method", None)
    if method is None or not callable(getattr(method, "process_weights_after_loading", None)):
        return fresh
    shadow = _shadow(module)
    shadow._parameters.update(fresh)
    m = _shadow(method) if isinstance(method, torch.nn.Module) else copy.copy(method)
    if hasattr(m, "moe_kernel"):
        m.moe_kernel = None
    shadow.quant_method = m
    m.process_weights_after_loading(shadow)
    return {name: shadow._parameters[name] for name in fresh}


def load_layer(model: torch.nn.Module, held: Holders, tensors: Iterable[tuple[str, torch.Tensor]]
               ) -> dict[tuple[str, str], torch.Tensor]:
    """The missed parameters of one layer's modules (`held`) loaded from `tensors` by the model's own `load_weights`
    into fresh parameters (the running ones are put back after it) and `processed`, by (module name, parameter)."""
    fresh = {(name, p): _fresh(module._parameters[p]) for name, module, params in held for p in params}
    running = {(name, p): module._parameters[p] for name, module, params in held for p in params}
    try:
        for name, module, params in held:
            for p in params:
                module._parameters[p] = fresh[name, p]
        model.load_weights(tensors)
    finally:
        for name, module, params in held:
            for p in params:
                module._parameters[p] = running[name, p]
    out: dict[tuple[str, str], torch.Tensor] = {}
    for name, module, params in held:
        out.update({(name, p): t for p, t in processed(module, {p: fresh[name, p] for p in params}).items()})
    return out


def _keep(misses: Misses, layer: int | None) -> Callable[[str], bool]:
    return lambda name: name.endswith(misses.checkpoint) and layer_of(name) == layer


def reload_missed(model: torch.nn.Module, misses: Misses, read: Read) -> int:
    """Load what the reload missed (`misses`) from the checkpoint `read` gives, layer by layer, into the running
    parameters' memory; the number of tensors copied. Raises where a processed tensor's shape or dtype is not the
    running one's (nothing of that layer is copied then)."""
    copied = 0
    for layer, held in holders(model, misses).items():
        new = load_layer(model, held, read(_keep(misses, layer)))
        modules = {name: module for name, module, _ in held}
        pairs = [(modules[name]._parameters[p], t) for (name, p), t in new.items()]
        for (name, p), (old, t) in zip(new, pairs):
            if (old.shape, old.dtype) != (t.shape, t.dtype):
                raise RuntimeError(f"{name}.{p}: the replayed load gives {tuple(t.shape)} {t.dtype}, the running "
                                   f"parameter is {tuple(old.shape)} {old.dtype}")
        for old, t in pairs:
            old.data.copy_(t)
        copied += len(pairs)
    return copied


def layout_holds(model: torch.nn.Module, misses: Misses, read: Read) -> str | None:
    """None when `reload_missed` lays out what it loads as vLLM's own load did: replayed on the first layer with the
    checkpoint the model holds now (`read`), each tensor equals the running one element for element. Otherwise
    why not."""
    found = holders(model, misses)
    if not found:
        return f"no module holds {', '.join(misses.params)}"
    layer = min(found, key=lambda i: -1 if i is None else i)
    held, tensors = found[layer], list(read(_keep(misses, layer)))
    if not tensors:
        return f"the checkpoint holds none of {', '.join(misses.checkpoint)} for layer {layer}"
    new = load_layer(model, held, tensors)
    modules = {name: module for name, module, _ in held}
    for (name, p), t in new.items():
        old = modules[name]._parameters[p]
        if (old.shape, old.dtype) != (t.shape, t.dtype):
            return f"{name}.{p}: replayed {tuple(t.shape)} {t.dtype}, held {tuple(old.shape)} {old.dtype}"
        if not torch.equal(t, old):
            return f"{name}.{p}: the replayed load does not lay the checkpoint out as vLLM's load did"
    return None
