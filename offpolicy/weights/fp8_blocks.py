"""Which fp8 block sizes an inference engine can serve for a model, and the `auto` choice of one.

An fp8 version is written with one `weight_block_size = [b0, b1]` (`weights.fp8_block_size`); the torch engine
dequantizes any block, but vLLM and SGLang run block-scaled GEMMs whose constraints depend on the model's
linear shapes and on the engine's tensor parallelism. Read in vLLM 0.26.0 and SGLang 0.5.14 (docs/weights.md,
"Block sizes", has the file:line of each):

- activations are quantized per token in groups along the input (vLLM: a group of `b0`,
  `Fp8LinearMethod.__init__`; SGLang: of `b1`), and the quantizer asserts that the group divides the input
  width: every fp8 linear's input per TP partition must be a multiple of the block;
- a row-parallel linear (`o_proj`, `down_proj`) splits its input over TP ranks: each split a multiple too;
- merged linears (q/k/v into qkv_proj, gate/up into gate_up_proj) and column-parallel splits need each part's
  output (per TP rank) a multiple of the block (`validate_fp8_block_shape` / `validate_block_quant_shapes`);
- vLLM only: square blocks (the activation group is `b0`, the weight's input blocks `b1`, and the Triton
  kernel asserts that both give the same count), powers of two >= 16 (the Triton kernel's tile is the block:
  `tl.arange` and `tl.dot`). 128 x 128 runs on CUTLASS / DeepGEMM on Hopper; any other block only on the Triton
  `w8a8_triton_block_scaled_mm` (no tuned configs ship for it). fp8 MoE experts are set up for 128 x 128
  blocks only (`Fp8MoEMethod`), so a model with fp8 experts takes 128 there.

`problems` lists what an engine would refuse for a block (pure; `{checkpoint name: shape}` in, strings out),
`choose` is the largest of `CANDIDATES` with none, and `resolve` turns `weights.fp8_block_size` (`auto` or a
block) into the block to write, or refuses naming the field and a block that works; `for_run` does so for a run's
engine and TP size, and `models.fp8_run` (the one place the run's block is resolved: learner, Megatron publish,
vLLM launch) pairs it with the model's checkpoint shapes. GPT-OSS (hidden 2880,
q/k/v outputs 4096/512/512): 128 does not divide 2880, 64 divides all, so `auto` gives [64, 64].
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from offpolicy.weights.fp8 import DEFAULT_SKIP, module_matches

if TYPE_CHECKING:
    from offpolicy.config import Config

CANDIDATES = (128, 64, 32, 16)  # square blocks `auto` tries, largest first
SERVED = ("vllm", "sglang")  # engines with block-scaled GEMMs (the torch engine dequantizes any block)
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # loaded into one linear (qkv, gate_up)
ROW_PARALLEL = ("o_proj", "down_proj")  # linears whose input TP splits; every other one splits its output


def fp8_linears(shapes: Mapping[str, Sequence[int]], skip: Iterable[str] = DEFAULT_SKIP) -> dict[str, tuple[int, int]]:
    """{module: (out, in)} of the checkpoint's weights an fp8 version stores in fp8 (`fp8.quantizable`'s rule:
    a 2-D `.weight` of a module `skip` does not name)."""
    skip = tuple(skip)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2:
            module = name[: -len(".weight")]
            if not any(module_matches(p, module) for p in skip):
                out[module] = (int(shape[0]), int(shape[1]))
    return out


def problems(shapes: Mapping[str, Sequence[int]], block: Sequence[int], engine: str = "vllm", tp: int = 1,
             skip: Iterable[str] = DEFAULT_SKIP) -> list[str]:
    """Why `engine` with tensor parallelism `tp` could not serve an fp8 version of a model with these checkpoint
    shapes in `block`; [] when it can (and always for the torch engine). One line per kind of fault, with the
    first module that has it."""
    if engine not in SERVED:
        return []
    bn, bk = int(block[0]), int(block[1])
    found: dict[str, str] = {}

    def fault(kind: str, text: str) -> None:
        found.setdefault(kind, text)

    if engine == "vllm":
        if bn != bk:
            fault("square", f"vLLM takes square blocks only, not {[bn, bk]} (it quantizes activations in groups of "
                            f"{bn} against weight blocks {bk} wide)")
        elif bn < 16 or bn & (bn - 1):
            fault("pow2", f"vLLM's Triton block GEMM takes powers of two >= 16 as the block, not {bn}")
    linears = fp8_linears(shapes, skip)
    refused = unserved(linears, shapes, engine)
    if refused:
        fault("model", refused)
    for module, (n_out, n_in) in linears.items():
        leaf = module.rsplit(".", 1)[-1]
        row = leaf in ROW_PARALLEL
        if tp > 1 and (n_in if row else n_out) % tp:
            fault("tp", f"{module}: its {'input' if row else 'output'} {n_in if row else n_out} does not split "
                        f"over {tp} TP ranks")
            continue
        k = n_in // tp if row else n_in
        if k % bk:
            fault("in", f"{module}: input {k}{' per TP rank' if row and tp > 1 else ''} is not a multiple of {bk} "
                        f"(activations are quantized in groups of the block along the input)")
        merged = any(leaf in group and sum(module.rsplit(".", 1)[0] + "." + m in linears for m in group) > 1
                     for group in MERGED)
        if not row and (merged or tp > 1) and (n_out // tp) % bn:
            fault("out", f"{module}: output {n_out // tp}{' per TP rank' if tp > 1 else ''} is not a multiple of "
                         f"{bn} ({'a part of a merged linear' if merged else 'a TP split'})")
        if engine == "vllm" and ".experts." in f".{module}." and (bn, bk) != (128, 128):
            fault("moe", f"{module}: vLLM's fp8 MoE experts are set up for 128 x 128 blocks only")
    return list(found.values())


def unserved(linears: Mapping[str, tuple[int, int]], shapes: Mapping[str, Sequence[int]], engine: str) -> str:
    """Why `engine` serves no fp8 version of this model in any block (`linears`: `fp8_linears` of its `shapes`), or
    "": SGLang's GPT-OSS (a checkpoint with attention sinks) with fp8 attention linears."""
    attention = next((m for m in linears if ".self_attn." in f"{m}."), None)
    if engine != "sglang" or attention is None or not any(n.endswith(".self_attn.sinks") for n in shapes):
        return ""
    return (f"{attention}: SGLang 0.5.14 builds GPT-OSS's attention without the quantization config "
            "(models/gpt_oss.py:512-527), so it would copy an fp8 version's attention weights into bf16 parameters "
            "unscaled and drop their scales (seen on an H200: those loads failed their fingerprint proof); serve fp8 "
            "GPT-OSS versions with rollout.engine=vllm, or use rollout.weights_format=mxfp4 or native with SGLang")


def choose(shapes: Mapping[str, Sequence[int]], engine: str = "vllm", tp: int = 1,
           skip: Iterable[str] = DEFAULT_SKIP) -> tuple[int, int] | None:
    """The largest square block of `CANDIDATES` that `engine` serves for these shapes; None if none."""
    for b in CANDIDATES:
        if not problems(shapes, (b, b), engine, tp, skip):
            return b, b
    return None


def resolve(setting: str | Sequence[int], shapes: Mapping[str, Sequence[int]], engine: str = "vllm", tp: int = 1,
            skip: Iterable[str] = DEFAULT_SKIP) -> tuple[int, int]:
    """`weights.fp8_block_size` as the block to write: `auto` = `choose` for `engine`, by vLLM's rules for the torch
    engine too (its versions then load in vLLM, SGLang and transformers alike; 128 x 128 when no candidate fits,
    since the torch engine dequantizes any block); a given block as it is if `engine` serves it. Raises
    ValueError naming the field, what the engine refuses and the block that works."""
    skip = tuple(skip)
    refused = unserved(fp8_linears(shapes, skip), shapes, engine)
    if refused:
        raise ValueError(f"fp8 versions (weights.formats, rollout.weights_format) with rollout.engine={engine}: "
                         f"{refused}")
    best = choose(shapes, engine if engine in SERVED else "vllm", tp, skip)  # versions any engine can serve
    if setting == "auto":
        if best is not None:
            return best
        if engine not in SERVED:
            return 128, 128
        raise ValueError(_refusal("auto", shapes, engine, tp, skip, None))
    block = (int(setting[0]), int(setting[1]))
    if problems(shapes, block, engine, tp, skip):
        raise ValueError(_refusal(block, shapes, engine, tp, skip, best))
    return block


def _refusal(setting, shapes, engine: str, tp: int, skip: tuple[str, ...], best: tuple[int, int] | None) -> str:
    tried = (128, 128) if setting == "auto" else setting
    why = "; ".join(problems(shapes, tried, engine, tp, skip))
    where = f"rollout.engine={engine} at TP {tp}"
    if best is not None:
        return (f"weights.fp8_block_size={list(tried)} cannot be served by {where} for this model: {why}. "
                f"Set weights.fp8_block_size=[{best[0]}, {best[1]}] (or auto: the largest of "
                f"{'/'.join(map(str, CANDIDATES))} that fits)")
    return (f"weights.fp8_block_size={setting if setting == 'auto' else list(tried)}: no square block of "
            f"{'/'.join(map(str, CANDIDATES))} can be served by {where} for this model ({why} with {list(tried)}); "
            "keep the modules named there native with weights.fp8_skip, or change the TP size")


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of an HF checkpoint directory, from its safetensors headers (no tensor is read);
    {} for a directory without shards (e.g. a hub id)."""
    from offpolicy.weights.safetensors_view import read_header

    out: dict[str, tuple[int, ...]] = {}
    for shard in sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []:
        header, _ = read_header(shard)
        out.update({n: tuple(i["shape"]) for n, i in header.items() if n != "__metadata__"})
    return out


def for_run(cfg: Config, shapes: Mapping[str, Sequence[int]], setting=None) -> tuple[int, int]:
    """The run's `weights.fp8_block_size` (or `setting`: "auto" or a block, e.g. a checkpoint's own) resolved
    (`resolve`) for its rollout engine and that engine's TP size (`rollout.vllm.tensor_parallel_size`,
    `rollout.sglang.tp_size`), against the model's checkpoint shapes."""
    engine = cfg.rollout.engine
    tp = {"vllm": cfg.rollout.vllm.tensor_parallel_size, "sglang": cfg.rollout.sglang.tp_size}.get(engine, 1)
    setting = cfg.weights.fp8_block_size if setting is None else setting
    return resolve(setting if setting == "auto" else tuple(setting), shapes, engine, tp, cfg.weights.fp8_skip)
