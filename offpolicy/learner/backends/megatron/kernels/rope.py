"""RoPE's cos and sin tables, made once per forward for every layer's q and k (model.compile_rope's rotation and
qkv.py's fused kernels read them)."""

from __future__ import annotations

import weakref

import torch

_LAST: dict[str, tuple] = {}


def tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(freqs) * mscale and sin(freqs) * mscale in `dtype` (rounded as megatron rounds its own), made once for
    every layer's q and k of a forward: megatron passes each layer the same `freqs` tensor, so the last tables are
    reused while `freqs` is that tensor, unmodified (its version), with the same mscale and dtype (a weak
    reference: a new forward's freqs is a new tensor and the old tables go with it)."""
    key = (mscale, dtype, freqs._version)
    last = _LAST.get("tables")
    if last is not None and last[0]() is freqs and last[1] == key:
        return last[2], last[3]
    cos_, sin_ = ((f(freqs) * mscale).to(dtype) for f in (torch.cos, torch.sin))
    _LAST["tables"] = (weakref.ref(freqs), key, cos_, sin_)
    return cos_, sin_
