"""Zero-copy reading of safetensors files: tensors as views on a private memory map.

The safetensors layout is an 8-byte little-endian header length, a JSON header mapping tensor
names to dtype, shape and byte offsets, then the raw data. Mapping the file and wrapping each byte
range with `torch.frombuffer` gives tensors that share pages with the file in shared memory: no
read, no copy. The map is copy-on-write (private), so a consumer that writes into a tensor never
changes the file. Each tensor keeps its map alive.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16", "F32", ...)."""
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be stored in safetensors by this store")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported safetensors dtype {name}")
    return _DTYPES[name]


def read_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def map_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file as zero-copy views on a private map of it."""
    header, base = read_header(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            numel *= d
        if end - begin != numel * dtype.itemsize or base + end > size:
            raise ValueError(f"{path}: tensor {name} has inconsistent offsets {begin}..{end}")
        if numel == 0:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=dtype, count=numel, offset=base + begin)
        out[name] = flat.view(info["shape"])
    return out
