"""MXFP4 in GPT-OSS's checkpoint layout: quantize, dequantize, and read such a checkpoint as bf16.

Format (OCP Microscaling, the layout of `openai/gpt-oss-*` checkpoints and of transformers'
`integrations/mxfp4.py`): a 2-D (or batched) weight `w[..., rows, cols]` is cut into groups of 32
along its last (input) dim; each group shares one power-of-two scale and holds 32 e2m1 values.

- `<name>_blocks`: uint8 `[..., rows, cols // 32, 16]`; byte `j` of a group holds element `2j` in its
  low nibble and element `2j + 1` in its high nibble (transformers `_convert_moe_packed_tensors`:
  `lut[blk & 0x0F]` goes to the even columns, `lut[blk >> 4]` to the odd ones).
- A nibble is e2m1: bit 3 the sign, bits 0-2 index `0, 0.5, 1, 1.5, 2, 3, 4, 6` (FP4_VALUES).
- `<name>_scales`: uint8 `[..., rows, cols // 32]`, e8m0: the group's scale is `2 ** (byte - 127)`.
- value = e2m1(nibble) * 2 ** (scale - 127).

Quantizing (`quantize`): the group's scale is the smallest power of two `s` with `amax <= 6 s`
(nothing is clipped; `2 ** -127`, byte 0, for an all-zero group), each `w / s` (exact: `s` is a power of two) is rounded to the nearest e2m1
value, ties to the even code (IEEE round-to-nearest-even on the 4-bit grid). So the error of an
element is at most half the grid step where it falls (`s/4`, `s/2` or `s`) and never more than
`amax / 3` of its group; `dequantize(*quantize(x)) == x` exactly when `x` is representable (each group
some `code * s` with a largest magnitude of 4 s or 6 s). Inputs must be finite.

GPT-OSS layout (transformers `models/gpt_oss/modeling_gpt_oss.py`, `GptOssExperts`): the bf16
parameters are `model.layers.N.mlp.experts.gate_up_proj` `[E, hidden, 2 * inter]` and `down_proj`
`[E, inter, hidden]` (used as `x @ W`); the checkpoint quantizes their transposes `[E, out, in]`
(groups along `in`), and transformers turns blocks back with `.transpose(1, 2)` after dequantizing.
Biases, router, attention, embeddings and lm_head stay bf16 (`MODULES_TO_NOT_CONVERT`).

API (the whole of it):
- `quantize(w) -> (blocks, scales)` and `dequantize(blocks, scales, dtype) -> w`: any `[..., rows, cols]`.
- `dequantize_into(blocks, scales, out)`: the same values written into `out` (any float dtype and strides, e.g.
  a transposed view of a `GptOssExperts` parameter): the torch engine's load, with no whole-tensor temporary.
  A 256-entry table turns each byte into its two float32 values (one gather), times the group's scale (its
  float32 bits built from the e8m0 byte), an exact product rounded once to `out`'s dtype on the store (float64
  for a float64 `out`); `CHUNK` output elements at a time, so a step's temporaries (an int32 index and the
  values) are bounded whatever the tensor's size. Eager torch ops on any device: nothing is compiled (a
  compile is paid by each process's first swap).
- `is_expert_weight(name)`: whether a bf16 GPT-OSS tensor name is one MXFP4 quantizes.
- `quantize_expert(name, w) -> {name_blocks: ..., name_scales: ...}`: bf16 parameter layout in,
  checkpoint names and layout out.
- `dequantized_tensors(get, names, dtype)`: reads a checkpoint (`get(name) -> tensor` over `names`)
  and yields `(name, tensor)` under the bf16 checkpoint's names and layouts, every other tensor as is;
  `pairs(names)`, `unpacked_shape(base, scales_shape)` and `dequantize_as(base, blocks, scales, out)` are its
  steps, for a loader that writes each pair into the model's own tensor (`weights/lowbit_load.py`).
- `quantization_config()`: the `config.json` `quantization_config` entry of an MXFP4 version.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator

import torch

from offpolicy.weights import triton_quant

GROUP = 32  # elements per scale
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; code | 8 negates
BLOCKS, SCALES = "_blocks", "_scales"
CHUNK = 1 << 24  # output elements per step of `dequantize_into` (its temporaries: 6 bytes per element at most)
# What stays bf16 in an MXFP4 GPT-OSS version: the `modules_to_not_convert` of openai/gpt-oss-20b's config.json.
MODULES_TO_NOT_CONVERT = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.(gate_up_proj|down_proj))$")

# Rounding to nearest, ties to the even code: a magnitude `a` gets the code that counts the boundaries
# below it; at a boundary whose lower code is even the tie stays down (`a > b`), odd goes up (`a >= b`).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # midpoints 0|0.5, 1|1.5, 2|3, 4|6: lower codes 0, 2, 4, 6
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints 0.5|1, 1.5|2, 3|4: lower codes 1, 3, 5


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w[..., rows, cols]` (cols % 32 == 0) -> (blocks uint8 [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32])."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"mxfp4: the last dim of a {tuple(w.shape)} tensor is not a multiple of {GROUP}")
    if triton_quant.available(w):  # a GPU: one kernel, the same bits (and the finiteness check)
        return triton_quant.mxfp4_quantize(w)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"mxfp4: a {tuple(w.shape)} tensor holds inf or nan")
    return _quantize(w)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1) (0 for amax == 0)
    # smallest e with 6 * 2**e >= amax: e = exp - 3 when mant <= 0.75, else exp - 2
    e = torch.where(mant <= 0.75, exp - 3, exp - 2).clamp(-E8M0_BIAS, E8M0_BIAS)
    e = e.masked_fill(amax == 0, -E8M0_BIAS)  # an all-zero group takes the smallest scale (byte 0)
    a = torch.ldexp(g.abs(), -e.unsqueeze(-1).to(torch.float32))
    code = torch.zeros_like(a, dtype=torch.uint8)
    for b in _TIES_DOWN:
        code += a > b
    for b in _TIES_UP:
        code += a >= b
    code |= (g < 0).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (e + E8M0_BIAS).to(torch.uint8)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize`: (blocks [..., rows, G, 16], scales [..., rows, G]) -> `[..., rows, G * 32]` in `dtype`."""
    out = torch.empty((*scales.shape, GROUP), dtype=dtype, device=blocks.device)
    return dequantize_into(blocks, scales, out.flatten(-2))


def dequantize_into(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`dequantize(blocks, scales, out.dtype)` written into `out` `[..., rows, G * 32]` (any strides); returns `out`."""
    _check(blocks, scales)
    want = (*scales.shape[:-1], scales.shape[-1] * GROUP)
    if tuple(out.shape) != want:
        raise ValueError(f"mxfp4: scales {tuple(scales.shape)} dequantize to {want}, not into {tuple(out.shape)}")
    whole = out
    if scales.dim() == 1:  # one row
        blocks, scales, out = blocks[None], scales[None], out[None]
    rows, groups = scales.shape[-2:]
    exact = torch.float64 if out.dtype == torch.float64 else torch.float32  # the product is exact in it, rounded once
    pairs = _pairs(blocks.device, exact)
    step = max(1, CHUNK // (groups * GROUP))
    with torch.no_grad():
        for lead in itertools.product(*map(range, scales.shape[:-2])):  # () once for a 2-D weight
            b, s, o = blocks[lead], scales[lead], out[lead].unflatten(-1, (groups, GROUP))
            for r in range(0, rows, step):
                vals = torch.nn.functional.embedding(b[r:r + step].to(torch.int32), pairs).flatten(-2)
                torch.mul(vals, _scale(s[r:r + step]).to(exact), out=o[r:r + step])
    return whole


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(want blocks = scales.shape + ({GROUP // 2},))")


_PAIRS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`[256, 2]` in `dtype`: byte -> (e2m1 value of its low nibble, of its high nibble), signs included."""
    if (device, dtype) not in _PAIRS:
        lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype)
        byte = torch.arange(256)
        _PAIRS[device, dtype] = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1).to(device)
    return _PAIRS[device, dtype]


def _scale(s: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes `[..., G]` -> float32 `2 ** (s - 127)` `[..., G, 1]`, from the bits: exponent field `s` for s >= 1
    (255: inf), 2**-127 (a subnormal, 0x00400000) for s = 0; exactly what `torch.ldexp(1, s - 127)` gives."""
    bits = torch.where(s > 0, s.to(torch.int32) << 23, 0x00400000)
    return bits.view(torch.float32).unsqueeze(-1)


def is_expert_weight(name: str) -> bool:
    """True for a bf16 GPT-OSS expert weight (`...mlp.experts.gate_up_proj` / `down_proj`), not its bias."""
    return _EXPERT.match(name) is not None


def quantize_expert(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """bf16 `GptOssExperts` parameter `[E, in, out]` -> `{name_blocks, name_scales}` over its transpose `[E, out, in]`."""
    if not is_expert_weight(name) or w.dim() != 3:
        raise ValueError(f"mxfp4: {name} {tuple(w.shape)} is not a GPT-OSS expert weight [experts, in, out]")
    blocks, scales = quantize(w.transpose(1, 2))
    return {name + BLOCKS: blocks, name + SCALES: scales}


def dequantized_tensors(get: Callable[[str], torch.Tensor], names: Iterable[str],
                        dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield a checkpoint's tensors under bf16 GPT-OSS names: `X_blocks` + `X_scales` -> `X` `[E, in, out]`.

    `get(name)` returns a raw checkpoint tensor; `names` are the names present. Expert weights come
    back in `GptOssExperts`' parameter layout (transposed, contiguous), any other MXFP4 pair as
    `[..., rows, cols]`; tensors that are not MXFP4 pairs come through unchanged (not cast); a `_blocks`
    without its `_scales` (or the reverse) raises, naming it.
    """
    present = set(names)
    quantized = pairs(present)
    halves = {n for pair in quantized.values() for n in pair}
    for name in sorted(present - halves):
        yield name, get(name)
    for base, (b, s) in sorted(quantized.items()):
        blocks, scales = get(b), get(s)
        out = torch.empty(unpacked_shape(base, scales.shape), dtype=dtype, device=blocks.device)
        yield base, dequantize_as(base, blocks, scales, out)


def pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """`{X: (X_blocks, X_scales)}` over a checkpoint's tensor names; a half without the other raises KeyError, naming it."""
    present = set(names)
    out = {}
    for name in present:
        if name.endswith(BLOCKS) and name[: -len(BLOCKS)] + SCALES not in present:
            raise KeyError(f"mxfp4: {name} has no {name[: -len(BLOCKS)] + SCALES} in the checkpoint")
        if name.endswith(SCALES):
            base = name[: -len(SCALES)]
            if base + BLOCKS not in present:
                raise KeyError(f"mxfp4: {name} has no {base + BLOCKS} in the checkpoint")
            out[base] = (base + BLOCKS, name)
    return out


def _expert(base: str, scales_shape) -> bool:
    return is_expert_weight(base) and len(scales_shape) == 3  # [E, out, G]: GptOssExperts holds [E, in, out]


def unpacked_shape(base: str, scales_shape) -> tuple[int, ...]:
    """The shape of tensor `base` whose `_scales` are `scales_shape`: `[E, in, out]` for an expert weight, else
    `[..., rows, groups * 32]`."""
    *lead, groups = scales_shape
    if _expert(base, scales_shape):
        return (lead[0], groups * GROUP, lead[1])
    return (*lead, groups * GROUP)


def dequantize_as(base: str, blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize pair `base` into `out` of `unpacked_shape` (e.g. the model's parameter, any dtype: in place, in its
    own layout; an expert weight is written through its transpose); returns `out`."""
    dequantize_into(blocks, scales, out.transpose(1, 2) if _expert(base, scales.shape) else out)
    return out


def quantization_config() -> dict:
    """The `quantization_config` of an MXFP4 GPT-OSS `config.json` (as openai/gpt-oss-20b ships it)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}
