"""FP8 block-wise weights in the layout SGLang and vLLM load as a pre-quantized checkpoint.

Format (DeepSeek-V3 / Qwen3-FP8 style, `quant_method: fp8`): each quantized linear weight
`<module>.weight` `[rows, cols]` (`[out, in]`, as nn.Linear stores it) is stored as float8 e4m3fn beside
`<module>.weight_scale_inv`, float32 `[ceil(rows / bn), ceil(cols / bk)]` for `weight_block_size =
[bn, bk]` (block rows along the output dim). The stored scale is the dequantization multiplier:
`w ~= weight.float() * weight_scale_inv` repeated over each block, the edge blocks of a shape the block
size does not divide cropped. Matched field for field against
- sglang 0.5.23 `srt/layers/quantization/fp8.py`: `Fp8Config.from_config` (346-387: `quant_method`,
  `activation_scheme`, `ignored_layers` or `modules_to_not_convert`, `weight_block_size`),
  `create_fp8_weight_` (639, 672-689: `weight_scale_inv` float32 of the ceil-div shape,
  `weight_block_size[0]` = block_n along the output dim; `validate_block_quant_shapes` 570-611 asks
  merged (qkv, gate_up) and TP-split partitions to be multiples of the block); `fp8_utils.py` `block_quant_dequant` (2044-2066: multiply, crop);
  `utils.py` `is_layer_skipped` (70-125: names matched on dotted module-path boundaries);
- vLLM `model_executor/layers/quantization/fp8.py` `Fp8Config.from_config` (reads `ignored_layers` only)
  and `Fp8LinearMethod.create_weights` (the same ceil-div `weight_scale_inv`), so `quantization_config`
  names the kept modules under both keys;
- transformers `integrations/finegrained_fp8.py` `Fp8Dequantize` (loads it with `dequantize=True`, but
  derives the block size from the scale grid, so only shapes the block size divides load right there).

Quantizing: per block `s = amax / 448` (448 = e4m3fn's largest finite value; `s = 1` for an all-zero
block), `weight = round_to_nearest_even_e4m3(w / s)` in float32 (torch's cast), clamped to +-448.
Error per element: at most `|w| * 2**-4` (3 mantissa bits) or, below e4m3's normal range, `s * 2**-10`.

What is quantized (`quantizable`): 2-D `*.weight` tensors whose module matches none of the `skip`
patterns (module-path boundary match, as SGLang's); norms and biases (1-D) and GPT-OSS's 3-D expert
tensors stay in the model's dtype. The default `skip` keeps embeddings, lm_head and MoE routers
(`weights.fp8_skip`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from offpolicy.weights import triton_quant

E4M3_MAX = 448.0
SCALE = "_scale_inv"  # suffix beside `.weight`: `<module>.weight_scale_inv`
DEFAULT_SKIP = ("embed_tokens", "lm_head", "mlp.gate", "mlp.router", "shared_expert_gate")


def quantize(w: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w[rows, cols]` -> (float8_e4m3fn `[rows, cols]`, float32 scale_inv `[ceil(rows/bn), ceil(cols/bk)]`)."""
    bn, bk = _block(block)
    if w.dim() != 2:
        raise ValueError(f"fp8: block-wise quantization takes a 2-D weight, not {tuple(w.shape)}")
    if triton_quant.available(w):  # a GPU: one kernel, the same bits
        return triton_quant.fp8_quantize(w, bn, bk)
    return _quantize(w, bn, bk)


def _quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // bn), -(-cols // bk)
    x = _blocks(w.float(), bn, bk)  # zero padding: the edge blocks' amax unchanged
    amax = x.abs().amax(dim=(1, 3), keepdim=True)
    # amax / a tensor: IEEE division on every device (CUDA divides by a Python scalar as a reciprocal product)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(nr * bn, nc * bk)[:rows, :cols].contiguous(), scale.reshape(nr, nc)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize`: `q.float() * scale_inv` over each block (edge blocks cropped), in `dtype`."""
    bn, bk = _block(block)
    rows, cols = q.shape
    want = (-(-rows // bn), -(-cols // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"fp8: a {tuple(q.shape)} weight with block {[bn, bk]} needs a scale of {want}, "
                         f"not {tuple(scale_inv.shape)}")
    return _dequantize(q, scale_inv, bn, bk, dtype)


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = q.shape
    x = _blocks(q.float(), bn, bk) * scale_inv.float()[:, None, :, None]
    return x.reshape(x.shape[0] * bn, x.shape[2] * bk)[:rows, :cols].to(dtype)


def _blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """`x[rows, cols]` zero-padded to whole blocks, as `[rows/bn, bn, cols/bk, bk]`."""
    rows, cols = x.shape
    nr, nc = -(-rows // bn), -(-cols // bk)
    return torch.nn.functional.pad(x, (0, nc * bk - cols, 0, nr * bn - rows)).view(nr, bn, nc, bk)


def block_rows(block: Sequence[int]) -> int:
    """Rows of one block of the block-wise scales: a row piece of a weight must start at a multiple of it."""
    return _block(block)[0]


def _block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"fp8: weight_block_size must be two positive ints, not {list(block)}")
    return int(block[0]), int(block[1])


def module_matches(pattern: str, module: str) -> bool:
    """`pattern` names `module` or one of its ancestors or a dotted run of its path ("mlp.gate" matches
    "model.layers.0.mlp.gate", never "model.layers.0.mlp.gate_proj")."""
    p = pattern.strip(".")
    return module == p or module.startswith(p + ".") or f".{p}." in f".{module}."


def quantizable(name: str, t: torch.Tensor, skip: Iterable[str] = DEFAULT_SKIP) -> bool:
    """Whether the checkpoint tensor `name` is stored in fp8: a 2-D `.weight` of a module not skipped."""
    if not name.endswith(".weight") or t.dim() != 2:
        return False
    module = name[: -len(".weight")]
    return not any(module_matches(p, module) for p in skip)


def quantize_tensors(named: Iterable[tuple[str, torch.Tensor]], block: Sequence[int],
                     skip: Iterable[str] = DEFAULT_SKIP) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """A checkpoint's tensors in fp8 (each quantized weight followed by its scale), and the modules whose
    2-D weight stayed unquantized (for `quantization_config`'s `ignored_layers`)."""
    skip = tuple(skip)
    out, kept = [], []
    for name, t in named:
        if quantizable(name, t, skip):
            q, s = quantize(t.detach(), block)
            out += [(name, q), (name + SCALE, s)]
        else:
            module = kept_module(name, t.dim())
            if module is not None:
                kept.append(module)
            out.append((name, t))
    return out, kept


def kept_module(name: str, dims: int) -> str | None:
    """The module whose weight the checkpoint tensor `name` (not quantized, `dims` dimensions) keeps in
    model.dtype, for `ignored_layers`: a 2-D `.weight`'s module, or the module of a 3-D fused experts weight
    (GPT-OSS's `mlp.experts.gate_up_proj` / `down_proj`: loaders would otherwise build fp8 experts for it);
    None for anything else (norms, biases)."""
    if name.endswith(".weight") and dims == 2:
        return name[: -len(".weight")]
    if dims == 3 and not name.endswith("bias") and "." in name:
        return name.rsplit(".", 1)[0]
    return None


def quantization_config(block: Sequence[int], ignored: Iterable[str]) -> dict:
    """`config.json`'s `quantization_config` of an fp8 version (both loaders' names for the kept modules)."""
    ignored = sorted(set(ignored))
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(_block(block)), "ignored_layers": ignored, "modules_to_not_convert": ignored}


def dequantized_tensors(get: Callable[[str], torch.Tensor], names: Iterable[str], block: Sequence[int],
                        dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield an fp8 checkpoint's tensors under the unquantized names: `X.weight` + `X.weight_scale_inv` ->
    `X.weight` in `dtype`; every other tensor unchanged. A weight or scale without its partner raises."""
    present = set(names)
    quantized = pairs(get, present)
    for name in sorted(present):
        if name.endswith(".weight" + SCALE):
            continue
        yield name, dequantize(get(name), get(name + SCALE), block, dtype) if name in quantized else get(name)


def pairs(get: Callable[[str], torch.Tensor], names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """`{X.weight: (X.weight, X.weight_scale_inv)}` over a checkpoint's float8 weights; a weight or scale without
    its partner raises KeyError, naming it."""
    present = set(names)
    out = {}
    for name in present:
        if name.endswith(".weight" + SCALE):
            if name[: -len(SCALE)] not in present:
                raise KeyError(f"fp8: {name} has no {name[: -len(SCALE)]} in the checkpoint")
        elif get(name).dtype == torch.float8_e4m3fn:
            if name + SCALE not in present:
                raise KeyError(f"fp8: {name} is float8 but has no {name + SCALE} in the checkpoint")
            out[name] = (name, name + SCALE)
    return out
