"""MXFP4 GPT-OSS experts written into a running engine's triton_kernels wrappers, in place, as its start-up load laid
out the first version: shared by SGLang's in-place MXFP4 loader (sglang/mxfp4_inplace.py) and vLLM's (vllm/kernels.py),
which differ only in where each engine keeps the wrappers.

Both engines' Triton MXFP4 MoE on Hopper load a version's experts as plain copies with one TP and EP rank (the values
`<experts>.gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 viewed as [E, rows, cols / 2], the scales [E, rows, cols / 32]),
then `_swizzle_mxfp4` transposes both and converts them to the wrapper's layout (SGLang `layers/quantization/mxfp4.py`
167-198, vLLM `quantization/utils/mxfp4_utils.py` 36-110; vLLM 0.26 first pads the scales' last dimension to a multiple
of 4 on Hopper, with zeros); the biases are widened to float32. Here the same steps run through the running wrapper's
own layout (`storage.layout.swizzle_data`) and the result is copied into its storage, so the kernels, and the CUDA
graphs captured on that memory, read the new version. A tensor whose result differs in shape or dtype from what is
held (another layout, TP or padding) is not written: the caller says why. Where an engine shards the experts over its
workers, each writes its own part, cut as both engines' GPT-OSS MXFP4 loaders cut the first version (`Shard`), zero-
padded to what its layer holds (`as_held`). Pure torch: tested with stand-in wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# a checkpoint tensor's suffix -> (the engines' projection, which part)
PARTS = {"gate_up_proj_blocks": ("w13", "value"), "gate_up_proj_scales": ("w13", "scale"),
         "gate_up_proj_bias": ("w13", "bias"), "down_proj_blocks": ("w2", "value"),
         "down_proj_scales": ("w2", "scale"), "down_proj_bias": ("w2", "bias")}


def expert_part(name: str) -> tuple[str, str, str] | None:
    """(the checkpoint's experts module, projection, part) of an expert tensor's name; None for any other tensor."""
    module, _, leaf = name.rpartition(".")
    return (module, *PARTS[leaf]) if module.endswith(".experts") and leaf in PARTS else None


def split(named: list) -> tuple[list[tuple[str, str, str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The experts' tensors as (the checkpoint's experts module, projection, part, tensor), the rest as (name,
    tensor)."""
    experts, rest = [], []
    for name, t in named:
        where = expert_part(name)
        if where is not None:
            experts.append((*where, t))
        else:
            rest.append((name, t))
    return experts, rest


def kernel_ready(part: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as the layout swizzles it: values as the [E, rows, cols / 2] bytes the engines load,
    transposed (`_swizzle_mxfp4`); scales transposed; biases float32."""
    if part == "value":
        return t.reshape(t.shape[0], t.shape[1], -1).transpose(-2, -1)
    if part == "scale":
        return t.transpose(-2, -1)
    return t.float()


def _padded_scale(wrapper: object, ready: torch.Tensor) -> torch.Tensor:
    """Transposed scales zero-padded along their block dimension to the wrapper's logical shape (vLLM 0.26 on Hopper
    pads it to a multiple of 4 before the swizzle); as given where the wrapper has no shape or it is not larger."""
    shape = getattr(wrapper, "shape", None)
    if shape is None or len(shape) != ready.dim() or list(shape[:-2]) != list(ready.shape[:-2]):
        return ready
    pad = int(shape[-2]) - ready.shape[-2]
    if pad <= 0 or int(shape[-1]) != ready.shape[-1]:
        return ready
    return torch.nn.functional.pad(ready, (0, 0, 0, pad))


def swizzled_for(wrapper: object, part: str, t: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """Checkpoint tensor `t` (a projection's values or scales) as a triton_kernels wrapper's storage holds it, through
    its own layout: (the tensor, None), or (None, why it cannot be held there)."""
    storage = getattr(wrapper, "storage", None)
    layout = getattr(storage, "layout", None)
    if storage is None or layout is None:
        return None, f"{part}: no triton_kernels wrapper (another MoE backend)"
    ready = kernel_ready(part, t)
    if part == "scale":
        ready = _padded_scale(wrapper, ready)
    swizzled = layout.swizzle_data(ready)
    if swizzled.shape != storage.data.shape or swizzled.dtype != storage.data.dtype:
        return None, f"{part}: swizzled {tuple(swizzled.shape)} {swizzled.dtype}, held {tuple(storage.data.shape)} " \
                     f"{storage.data.dtype}"
    return swizzled, None


def into_wrapper(wrapper: object, part: str, t: torch.Tensor | None,
                 swizzled: torch.Tensor | None = None) -> str | None:
    """Write checkpoint tensor `t` (a projection's values or scales) into a triton_kernels wrapper's storage through
    its own layout (`swizzled_for`), or `swizzled`, what `swizzled_for` made of it ahead (a staging's `prepared`); why
    not (None when written)."""
    held = getattr(getattr(wrapper, "storage", None), "data", None)
    if swizzled is None:  # made here, checked against what is held by `swizzled_for`
        swizzled, why = swizzled_for(wrapper, part, t)
        if why is not None:
            return why
    elif held is None or held.shape != swizzled.shape or held.dtype != swizzled.dtype:
        return f"{part}: prepared {tuple(swizzled.shape)} {swizzled.dtype}, held " \
               f"{None if held is None else (tuple(held.shape), held.dtype)}"
    held.copy_(swizzled)
    return None


def into_bias(held: torch.Tensor | None, t: torch.Tensor, name: str) -> str | None:
    """Write checkpoint bias `t` as the engines hold it (float32, `kernel_ready`) into `held`, the engine's `name`;
    why not (None when written)."""
    data = kernel_ready("bias", t)
    if held is None or held.shape != data.shape:
        return f"{name}: held {None if held is None else tuple(held.shape)}, given {tuple(data.shape)}"
    held.data.copy_(data)
    return None


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint's experts one worker holds, as vLLM 0.26's and SGLang 0.5.14's GPT-OSS MXFP4 loaders cut
    them (vLLM `models/gpt_oss.py` `_load_weights_mxfp4`, SGLang `models/gpt_oss.py:915-1080`): the experts
    [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size); the intermediate dimension I in blocks of 32, ceil(blocks /
    tp_size) blocks a rank (the last fewer): gate_up's interleaved rows [2 start, 2 end), down's columns [start, end);
    down's bias on MoE-TP rank 0, zeros on the others. The sizes and ranks are the engine's MoE ones (TP flattened over
    data parallelism where the engine does so)."""
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def cut(self, proj: str, part: str, t: torch.Tensor) -> torch.Tensor:
        """This worker's part of checkpoint tensor `t` (values [E, rows, cols / 32, 16], scales [E, rows, cols / 32],
        biases [E, rows])."""
        if self.ep_size > 1:
            per = t.shape[0] // self.ep_size
            t = t[self.ep_rank * per:(self.ep_rank + 1) * per]
        if self.tp_size == 1:
            return t
        if proj == "w2" and part == "bias":
            return t if self.tp_rank == 0 else torch.zeros_like(t)
        inter = t.shape[1] // 2 if proj == "w13" else t.shape[2] * 32
        per = -(-(inter // 32) // self.tp_size) * 32
        start, end = min(self.tp_rank * per, inter), min((self.tp_rank + 1) * per, inter)
        return t[:, 2 * start:2 * end] if proj == "w13" else t[:, :, start // 32:end // 32]


WHOLE = Shard()


def as_held(gate_up_bias: torch.Tensor | None, proj: str, part: str, t: torch.Tensor,
            shard: Shard = WHOLE) -> torch.Tensor:
    """A worker's part (`shard`'s cut) of checkpoint tensor `t`, zero-padded along the intermediate dimension to what
    its layer holds, told by the layer's gate_up bias ([E, 2 I held]): both engines round a rank's I up (to a
    multiple of 64 for the triton_kernels MoE) and their loaders copy into the start of the zeroed parameter."""
    t = shard.cut(proj, part, t)
    if gate_up_bias is None or gate_up_bias.dim() != 2 or (proj == "w2" and part == "bias"):
        return t
    dim, size = (1, gate_up_bias.shape[1]) if proj == "w13" else (2, gate_up_bias.shape[1] // 2 // 32)
    short = size - t.shape[dim]
    return torch.nn.functional.pad(t, [0, 0] * (t.dim() - dim - 1) + [0, short]) if short > 0 else t
