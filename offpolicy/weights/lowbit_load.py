"""Reading a low-bit version (fp8, mxfp4) into a model's own tensors, dequantized: the torch engine's load.

- `shapes(wv, dtype)`: what the version becomes, native name -> (shape, dtype), from its headers alone (the
  engine checks it against its model before a byte is read).
- `read_into(wv, dest, maps=None, sync=True)`: one parallel read of the version's shards
  (`transfer.load_version`) puts every tensor that is not quantized straight into `dest[name]` (in place, as a
  native version is read) and the quantized bytes (fp8 weights and scales, mxfp4 blocks and scales) into
  staging tensors on `dest`'s device; each quantized weight is then dequantized on that device into its `dest`
  tensor, in place (mxfp4 experts through a transposed view: `mxfp4.dequantize_as`), and its staging freed.

So the model keeps its tensors as a native load leaves them (same storage, dtype and strides: the decode step
multiplies the same operands), and the load's temporaries are the quantized bytes (about a quarter of the
experts' bf16 bytes for mxfp4) plus one weight's dequantize at a time (mxfp4: `mxfp4.CHUNK` elements; fp8: one
weight's float32 blocks): no second copy of the model, nothing compiled. With `sync=False` (a background read
on its own CUDA stream: the double buffer) the work is queued on the current stream and not waited for.
`profile.stage` names: `lowbit.plan`, the read's `load.*`, `lowbit.dequantize`, `lowbit.sync`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offpolicy.weights import fp8, mxfp4
from offpolicy.weights.formats import quantization
from offpolicy.weights.profile import stage
from offpolicy.weights.transfer import load_version

if TYPE_CHECKING:
    from offpolicy.weights.version import WeightVersion


def _quantized(wv: WeightVersion) -> tuple[dict[str, tuple[str, str]], dict]:
    """({native name: (quantized weight or blocks, scales)}, quantization_config) of a low-bit version."""
    qc = quantization(wv)
    t = wv.tensors
    if wv.manifest.format == "fp8":
        return fp8.pairs(t.__getitem__, t), qc
    if wv.manifest.format == "mxfp4":
        return mxfp4.pairs(t), qc
    raise ValueError(f"weight version {wv.version} at {wv.path}: {wv.manifest.format!r} is no low-bit format")


def shapes(wv: WeightVersion, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Native name -> (shape, dtype) of what `read_into` writes: dequantized weights in `dtype`, the rest as stored."""
    quantized, _ = _quantized(wv)
    halves = {n for pair in quantized.values() for n in pair}
    out = {n: (tuple(t.shape), t.dtype) for n, t in wv.tensors.items() if n not in halves}
    for base, (q, s) in quantized.items():
        shape = wv.tensors[q].shape if wv.manifest.format == "fp8" else mxfp4.unpacked_shape(base, wv.tensors[s].shape)
        out[base] = (tuple(shape), dtype)
    return out


def read_into(wv: WeightVersion, dest: dict[str, torch.Tensor], maps=None, sync: bool = True) -> None:
    """Read low-bit version `wv` into `dest` (the model's tensors by native name, checked with `shapes` first)."""
    with stage("lowbit.plan"):
        quantized, qc = _quantized(wv)
        halves = {n for pair in quantized.values() for n in pair}
        device = next(iter(dest.values())).device
        staged = {n: torch.empty(wv.tensors[n].shape, dtype=wv.tensors[n].dtype, device=device) for n in halves}
        into = {n: dest[n] for n in wv.tensors if n not in halves}
    load_version({**into, **staged}, wv.path, maps=maps, sync=False)  # later work on this stream waits for it
    del into
    with stage("lowbit.dequantize"), torch.no_grad():
        for base, (qname, sname) in sorted(quantized.items()):
            q, s, out = staged.pop(qname), staged.pop(sname), dest[base]
            if wv.manifest.format == "mxfp4":
                mxfp4.dequantize_as(base, q, s, out)
            else:
                out.copy_(fp8.dequantize(q, s, qc["weight_block_size"], out.dtype))
            del q, s  # the staging goes back to the allocator weight by weight
    if sync and device.type == "cuda":
        with stage("lowbit.sync"):
            torch.cuda.synchronize(device)
