"""A freshly built vLLM model's state given to the running model, in the running tensors' own memory.

The rebuild load (worker.py) builds the version as a fresh model with vLLM's own start-up path, then hands
its state to the running modules, which vLLM's runner, its compiled graphs and its CUDA graphs hold. CUDA
graphs (rollout.vllm.enforce_eager false) replay the kernels captured at start-up on the memory they read
then: a tensor replaced by reference leaves them reading the old one (freed, soon garbage: on an H200 the
GPT-OSS slice's server answered NaN logprobs). So `adopt` copies each tensor into the running one where
shape, dtype and device agree, and moves a tensor by reference only where they do not (or the running
module has none of that name): then the module's other attributes (kernel objects built around its
tensors) are taken from the fresh module too, as the whole state was before.

Tensors are those `fingerprint.owned` finds (the same ones the load's proof hashes). Attention layers keep
their KV-cache binding: only their tensors are taken, never their other attributes. `release` then lets the fresh
model's memory go at once. Pure torch, no vLLM.
"""

from __future__ import annotations

import torch

from offpolicy.rollout.engines.fingerprint import owned


def _put(holder: object, key: str, t: torch.Tensor) -> None:
    if isinstance(holder, torch.nn.Module) and key in holder._parameters:
        holder._parameters[key] = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
    elif isinstance(holder, torch.nn.Module) and key in holder._buffers:
        holder._buffers[key] = t
    else:
        setattr(holder, key, t)


@torch.no_grad()
def adopt(running: dict[str, torch.nn.Module], fresh: torch.nn.Module, attention: set[int]) -> dict[str, int]:
    """Give `fresh`'s modules' state to the running modules of the same names (`running`: name -> module);
    modules whose id is in `attention` take their tensors only. Counts of tensors copied in place and moved
    by reference, and the names of the modules with a moved tensor (the first 20)."""
    copied = moved = 0
    moved_in: list[str] = []
    for name, new in fresh.named_modules():
        old = running[name]
        mine = {n: (holder, key, t) for n, holder, key, t in owned(old)}
        whole = True
        for n, _, key, t in owned(new):
            have = mine.get(n)
            if have is not None and (have[2].shape, have[2].dtype, have[2].device) == (t.shape, t.dtype, t.device):
                have[2].copy_(t)
                copied += 1
                continue
            whole = False
            moved += 1
            if have is not None:  # another shape or dtype: replaced where the running module holds it
                _put(have[0], have[1], t)
            elif "." not in n:  # one the running module lacks, of the module itself (a held object's: below)
                _put(old, key, t)
        if not whole:
            moved_in.append(name)
            if id(old) not in attention:  # everything the fresh layer built around its moved tensors
                old.__dict__.update({k: v for k, v in vars(new).items() if k != "_modules"})
    return {"copied": copied, "moved": moved, "moved_in": moved_in[:20]}


def release(fresh: torch.nn.Module, running: dict[str, torch.nn.Module]) -> None:
    """Drop what each module of `fresh` holds after `adopt` into `running` (name -> module), so its GPU memory is
    freed now, by reference counts. vLLM's modules sit in reference cycles (a parameter's `weight_loader` is its
    layer's bound method), which only Python's cyclic collector would free, and large GPU tensors with few Python
    objects seldom trigger it: on a GPU each MXFP4 rebuild so kept a model's worth of memory until a later one ran
    out (docs/vllm.md, "The rebuild load"). Left whole: a module the running model holds too (vLLM caches some, e.g.
    `get_rope`'s rotary embeddings, and hands the same object to every model it builds), and a fresh module whose
    state a running one took by reference (`adopt`, a moved tensor: the same parameter dict): what the running one
    took may call back into it."""
    held = {id(m) for m in running.values()}
    for name, module in list(fresh.named_modules()):
        taken = running.get(name)
        shared = taken is not None and taken.__dict__.get("_parameters") is module.__dict__.get("_parameters")
        if id(module) not in held and not shared:
            module.__dict__ = {}
