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
- `is_expert_weight(name)`: whether a bf16 GPT-OSS tensor name is one MXFP4 quantizes.
- `quantize_expert(name, w) -> {name_blocks: ..., name_scales: ...}`: bf16 parameter layout in,
  checkpoint names and layout out.
- `dequantized_tensors(get, names, dtype)`: reads a checkpoint (`get(name) -> tensor` over `names`)
  and yields `(name, tensor)` under the bf16 checkpoint's names and layouts, every other tensor as is.
- `quantization_config()`: the `config.json` `quantization_config` entry of an MXFP4 version.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from offpolicy.weights import triton_quant
from offpolicy.weights.fused import on_gpu

GROUP = 32  # elements per scale
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; code | 8 negates
BLOCKS, SCALES = "_blocks", "_scales"
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


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
               compiled: bool = True) -> torch.Tensor:
    """Inverse of `quantize`: (blocks [..., rows, G, 16], scales [..., rows, G]) -> `[..., rows, G * 32]` in `dtype`.
    `compiled=False` runs eagerly on a GPU too (a one-off load, where compiling would cost more than it saves)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(want blocks = scales.shape + ({GROUP // 2},))")
    return (_dequantize if compiled else _dequantize.eager)(blocks, scales, dtype)


@on_gpu
def _dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=blocks.device)
    vals = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    vals = torch.ldexp(vals, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1).to(torch.float32))
    return vals.flatten(-2).to(dtype)


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
    back in `GptOssExperts`' parameter layout (transposed), any other MXFP4 pair as `[..., rows, cols]`;
    tensors that are not MXFP4 pairs come through unchanged (not cast); a `_blocks` without its
    `_scales` (or the reverse) raises, naming it.
    """
    present = set(names)
    for name in sorted(present):
        if name.endswith(BLOCKS):
            base = name[: -len(BLOCKS)]
            if base + SCALES not in present:
                raise KeyError(f"mxfp4: {name} has no {base + SCALES} in the checkpoint")
            w = dequantize(get(name), get(base + SCALES), dtype)
            yield base, (w.transpose(1, 2).contiguous() if is_expert_weight(base) and w.dim() == 3 else w)
        elif name.endswith(SCALES):
            if name[: -len(SCALES)] + BLOCKS not in present:
                raise KeyError(f"mxfp4: {name} has no {name[: -len(SCALES)] + BLOCKS} in the checkpoint")
        else:
            yield name, get(name)


def quantization_config() -> dict:
    """The `quantization_config` of an MXFP4 GPT-OSS `config.json` (as openai/gpt-oss-20b ships it)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}
