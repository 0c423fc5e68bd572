"""A native HF checkpoint directory written again in a low-bit weight format, shard by shard.

An engine that takes its quantization from the checkpoint it starts with (a vLLM server builds fp8 or MXFP4
layers only from a checkpoint whose `config.json` says so) must start from a checkpoint of the format its
versions come in; `convert` makes one from the native checkpoint with the publisher's own encoding
(`formats.encode_piece` and `formats.config_of`), so its tensors are bit for bit what a version of the same
weights would hold. One source shard is in memory at a time; the result appears whole (written under a
temporary name, then renamed) or not at all. Files that are not tensors (generation_config.json, tokenizer
files) are copied.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from offpolicy.weights.formats import NATIVE, checkpoint_format, config_of, encode_piece
from offpolicy.weights.store import INDEX


def convert(src: str | Path, dst: str | Path, fmt: str, fp8_block: Sequence[int] = (128, 128),
            fp8_skip: Iterable[str] | None = None) -> Path:
    """Write the native checkpoint at `src` in `fmt` at `dst` (replacing nothing: `dst` must not exist)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    found = checkpoint_format(src)
    if found != NATIVE:
        raise ValueError(f"{src}: a checkpoint to convert must be native (model.dtype, no quantization_config); "
                         f"its config.json says {found or 'nothing readable'}")
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{src}: no *.safetensors shards to convert")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; remove it or pick another directory")
    tmp = dst.with_name(dst.name + ".converting")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs: dict[str, tuple[str, Sequence[int]]] = {}
    weight_map: dict[str, str] = {}
    skip = None if fp8_skip is None else tuple(fp8_skip)
    for shard in shards:
        out = {}
        for name, t in load_file(str(shard)).items():
            for n, q, _ in encode_piece(fmt, name, t, None, fp8_block, skip):
                out[n] = q.contiguous()
                specs[n] = (str(q.dtype), tuple(q.shape))
                weight_map[n] = shard.name
        save_file(out, str(tmp / shard.name), metadata={"format": "pt"})
    config = config_of(fmt, json.loads((src / "config.json").read_text()), specs, fp8_block)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    total = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for f in src.iterdir():  # generation config, tokenizer files
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)
    return dst
