"""Weight formats of a published version: `native` (model.dtype, as trained), `fp8`, `mxfp4`.

Each format has a store of its own beside the native one: `<root>/<run>/v<N>/` (native) and
`<root>/<run>/<format>/v<N>/` (e.g. `fp8/v7/`); `store_run(run, fmt)` is the run name the store API
(`WeightStore`, `subscribe`, `list_versions`, `version_dir`, the relay) takes for a format, so all of it
works on any format unchanged. A format store's hidden files and versions never collide with the native
store's (`v<N>` and `.`-names only), and removing `<root>/<run>/` (a fresh run, a fresh relay) removes
every format. Each version directory is a complete HF checkpoint of its format: safetensors shards, the
index, `config.json` with the format's `quantization_config`, and `manifest.json` whose `format` names it.

- `encode(fmt, named, hf_config, ...)`: the learner's (HF name, tensor) pairs and config.json in `fmt`
  (quantized on the tensors' device: pure torch ops, so on the learner's GPU in the publish path);
- `decode(wv, dtype)`: a held `WeightVersion` of any format as (HF name, tensor) pairs of the native
  checkpoint's names and shapes (dequantized), what the torch engine loads;
- `quantization(wv)`: a low-bit version's `quantization_config`, checked against its manifest;
  `weights/lowbit_load.py` reads a low-bit version into a model's own tensors (the torch engine's load);
- `checkpoint_format(path)`: the format of any HF directory by its config.json (the SGLang adapter
  checks a server's launch checkpoint with it);
- `encode_piece(fmt, name, t, row, ...)` and `config_of(fmt, hf_config, tensors, ...)`: the same
  encoding one piece at a time (a sharded publish: each learner rank quantizes the tensors, or the rows of
  a fused tensor, that it writes), and the config.json of the whole version from its tensors' names,
  dtypes and shapes; `encode` == pieces of every tensor whole + `config_of`, bit for bit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from offpolicy.weights.version import WeightVersion

NATIVE = "native"
LOW_BIT = ("fp8", "mxfp4")
FORMATS = (NATIVE, *LOW_BIT)


def store_run(run: str, fmt: str) -> str:
    """The store's run name of format `fmt`: `run` itself for native, `run/<fmt>` for a low-bit format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
    return run if fmt == NATIVE else f"{run}/{fmt}"


def part_run(run: str, fmt: str, node: int | None) -> str:
    """The store (run name) of learner node `node`'s part of format `fmt` (`<format's store>/node<k>`: a learner
    on several nodes commits each node's files there, weights/sharded.py; the relay's sources read it), or the
    format's own store when `node` is None."""
    return store_run(run, fmt) if node is None else f"{store_run(run, fmt)}/node{node}"


def checkpoint_format(path: str | os.PathLike) -> str | None:
    """The format of the HF checkpoint directory at `path` by its config.json: `native` without a
    `quantization_config`, else its `quant_method` ("fp8", "mxfp4", or another method's name); None when
    there is no readable config.json there (a hub id, another node's path)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return NATIVE if not qc else str(qc.get("quant_method", "unknown"))


def encode(fmt: str, named: Iterable[tuple[str, torch.Tensor]], hf_config: dict,
           fp8_block: Sequence[int] | str = (128, 128), fp8_skip: Iterable[str] | None = None,
           ) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """(tensors, config.json) of a version in `fmt`; the input tensors are not changed. `fp8_skip`
    None = fp8.DEFAULT_SKIP; `fp8_block` "auto" (a caller that did not resolve weights.fp8_block_size for its
    engine, as the learner does) = the largest block `fp8_blocks.choose` finds for these tensors."""
    from offpolicy.weights import fp8, fp8_blocks, mxfp4  # torch: only writers and loaders need it, not the relay

    config = dict(hf_config)
    if fmt == NATIVE:
        return list(named), config
    if fmt == "fp8":
        skip = fp8.DEFAULT_SKIP if fp8_skip is None else tuple(fp8_skip)
        if fp8_block == "auto":
            named = list(named)
            fp8_block = fp8_blocks.resolve("auto", {n: tuple(t.shape) for n, t in named}, "torch", 1, skip)
        out, kept = fp8.quantize_tensors(named, fp8_block, skip)
        config["quantization_config"] = fp8.quantization_config(fp8_block, kept)
        return out, config
    if fmt == "mxfp4":
        out, n = [], 0
        for name, t in named:
            if mxfp4.is_expert_weight(name):
                out += list(mxfp4.quantize_expert(name, t.detach()).items())
                n += 1
            else:
                out.append((name, t))
        if not n:
            raise ValueError("weights.formats: mxfp4 quantizes GPT-OSS MoE experts (mlp.experts.gate_up_proj / "
                             "down_proj), and this model has none; publish fp8 instead, or train a gpt_oss model")
        config["quantization_config"] = mxfp4.quantization_config()
        return out, config
    raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")


def encode_piece(fmt: str, name: str, t: torch.Tensor, row: int | None = None, fp8_block: Sequence[int] = (128, 128),
                 fp8_skip: Iterable[str] | None = None) -> list[tuple[str, torch.Tensor, int | None]]:
    """One piece of checkpoint tensor `name` (the whole tensor when `row` is None, else its rows row ..
    row + len(t) of the first dimension) in `fmt`: [(name, tensor, first row)], a quantized weight followed
    by its scales. fp8 quantizes a row piece that starts on a block boundary (`row` a multiple of the
    block's rows; the tensor's last, partial block then lies in its last piece), its scales being rows
    row / block rows ..; another row piece raises. mxfp4 quantizes each expert of GPT-OSS's fused expert
    weights on its own, so a piece of experts gives those experts' rows."""
    from offpolicy.weights import fp8, mxfp4

    if fmt == NATIVE:
        return [(name, t, row)]
    if fmt == "fp8":
        skip = fp8.DEFAULT_SKIP if fp8_skip is None else tuple(fp8_skip)
        if not fp8.quantizable(name, t, skip):
            return [(name, t, row)]
        rows = fp8.block_rows(fp8_block)
        if row is not None and row % rows:
            raise ValueError(f"fp8: a piece of {name} starts at row {row}, inside a {rows}-row block of the "
                             "block-wise scales (pieces must start on a block boundary)")
        q, s = fp8.quantize(t.detach(), fp8_block)
        return [(name, q, row), (name + fp8.SCALE, s, None if row is None else row // rows)]
    if fmt == "mxfp4":
        if not mxfp4.is_expert_weight(name):
            return [(name, t, row)]
        return [(n, q, row) for n, q in mxfp4.quantize_expert(name, t.detach()).items()]
    raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")


def config_of(fmt: str, hf_config: dict, tensors: dict[str, tuple[str, Sequence[int]]],
              fp8_block: Sequence[int] = (128, 128)) -> dict:
    """The config.json of a version in `fmt` whose tensors (name -> (safetensors dtype, shape)) were
    encoded piece by piece (`encode_piece`): `hf_config` with the format's `quantization_config`."""
    from offpolicy.weights.config_json import complete
    from offpolicy.weights import fp8, mxfp4

    config = complete(hf_config)
    if fmt == "fp8":
        kept = [m for n, (_, shape) in tensors.items() if n + fp8.SCALE not in tensors
                for m in [fp8.kept_module(n, len(shape))] if m is not None]
        config["quantization_config"] = fp8.quantization_config(fp8_block, kept)
    elif fmt == "mxfp4":
        if not any(n.endswith(mxfp4.BLOCKS) and mxfp4.is_expert_weight(n[: -len(mxfp4.BLOCKS)]) for n in tensors):
            raise ValueError("weights.formats: mxfp4 quantizes GPT-OSS MoE experts (mlp.experts.gate_up_proj / "
                             "down_proj), and this model has none; publish fp8 instead, or train a gpt_oss model")
        config["quantization_config"] = mxfp4.quantization_config()
    elif fmt != NATIVE:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
    return config


def decode(wv: WeightVersion, dtype: torch.dtype, device: torch.device | str | None = None, maps=None,
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a held version under native names and shapes: a native version's as stored
    (zero-copy views); a low-bit version's moved to `device` (if given) and dequantized there to `dtype`.
    On a GPU the stored tensors are read by `transfer.load_version` (parallel reads, through `maps`'
    page-locked files where it holds them) rather than copied one by one from pageable memory."""
    import torch

    from offpolicy.weights import fp8, mxfp4
    from offpolicy.weights.transfer import load_version

    tensors, fmt = wv.tensors, wv.manifest.format
    if fmt == NATIVE:
        return iter(tensors.items())
    if device is not None and torch.device(device).type == "cuda":
        raw = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in tensors.items()}
        load_version(raw, wv.path, maps=maps)
        tensors = raw
    elif device is not None:
        tensors = {n: t.to(device) for n, t in tensors.items()}
    qc = quantization(wv)
    if fmt == "fp8":
        return fp8.dequantized_tensors(tensors.__getitem__, tensors, qc["weight_block_size"], dtype)
    if fmt == "mxfp4":
        return mxfp4.dequantized_tensors(tensors.__getitem__, tensors, dtype)
    raise ValueError(f"weight version {wv.version} at {wv.path} has unknown format {fmt!r}")


def quantization(wv: WeightVersion) -> dict:
    """The `quantization_config` of low-bit version `wv`'s config.json, checked against its manifest's format."""
    fmt = wv.manifest.format
    qc = json.loads((wv.path / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != fmt:
        raise ValueError(f"weight version {wv.version} at {wv.path}: manifest says {fmt}, config.json's "
                         f"quantization_config says {qc.get('quant_method')!r}")
    return qc
