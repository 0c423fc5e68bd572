"""Full HF tensors by name for the Megatron loader, on the rank's device: a safetensors directory, a
state dict, or `model.arch`'s seeded initial weights.

Every source answers `get(name, row=None)`: checkpoint tensor `name`, or only `name[row]` (one expert
of a fused tensor), in the source's `dtype` on its `device`, so that a rank reads and makes only what it
holds and shards it on its GPU.
- `HFSource(path=...)`: a safetensors directory. Each file is opened once (memory-mapped) and a rank
  reads only the tensors it asks for, an expert row alone. An MXFP4 checkpoint (`config.json` `quantization_config.quant_method: mxfp4`, GPT-OSS's release
  format) stores expert weights as `<name>_blocks` (uint8 e2m1 pairs) + `<name>_scales` (e8m0) over
  their transpose; asking for `<name>` moves the packed bytes to the device and dequantizes them there
  (`offpolicy.weights.mxfp4`) to `dtype`, the configured training dtype, in the bf16 checkpoint's layout
  (`GptOssExperts`' `[E, in, out]`; one `row` = one expert, `[in, out]`), so the learner trains a
  bf16/fp32 copy of the released weights. Other quantized checkpoints are refused with the field and the
  fix.
- `SeededSource`: `model.arch`'s initial weights (`offpolicy.models.build.initial_tensor`), each tensor or
  expert row drawn on the device from its own seed, so no rank builds the whole HF model.
The last row asked for is kept (a fused GPT-OSS row serves its gate and its up half); `reads` counts
what was read from disk or drawn, by (name, row), and `bytes` its size.
Invariants: for an MXFP4 directory, get(name)[e] == get(name, row=e) == mxfp4.dequantize(blocks[e],
scales[e]).T exactly; for `SeededSource`, get(name, row=e) == the row of `offpolicy.models.build.build_model`'s
tensor on the same device type.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch


class _Source:
    """`get` with a one-row cache, dtype and device; subclasses give `_make(name, row)` and count in
    `reads` ((checkpoint name, row) -> times read from disk or drawn) and `bytes` what they read or drew."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str):
        self.dtype, self.device = dtype, torch.device(device)
        self._last: tuple[tuple[str, int | None], torch.Tensor] | None = None
        self.reads: Counter[tuple[str, int | None]] = Counter()
        self.bytes = 0

    def _count(self, name: str, row: int | None, t: torch.Tensor) -> torch.Tensor:
        self.reads[(name, row)] += 1
        self.bytes += t.numel() * t.element_size()
        return t

    def get(self, name: str, row: int | None = None) -> torch.Tensor:
        key = (name, row)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        t = self._make(name, row)
        self._last = (key, t) if row is not None else None
        return t

    def _make(self, name: str, row: int | None) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        self._last = None


class HFSource(_Source):
    def __init__(self, path: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        super().__init__(dtype, device)
        self._open: dict[Path, object] = {}
        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.exists():
            self.files: dict[str, Path] = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = root / "model.safetensors"
            self.files = {k: single for k in self._handle(single).keys()}
        qc = json.loads((root / "config.json").read_text()).get("quantization_config") or {}
        method = qc.get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"model.path {path}: config.json quantization_config quant_method {method!r} is not "
                             "read by learner.backend=megatron (only mxfp4 is); give model.path a bf16 checkpoint")
        self.mxfp4 = method == "mxfp4"

    def _make(self, name: str, row: int | None) -> torch.Tensor:
        """Tensor `name`, or only `name[row]`; MXFP4 pairs dequantized to `self.dtype` on the device."""
        if name not in self.files and self.mxfp4 and name + "_blocks" in self.files:
            from offpolicy.weights import mxfp4

            w = mxfp4.dequantize(self._read(name + "_blocks", row), self._read(name + "_scales", row), self.dtype)
            return w.transpose(-1, -2).contiguous() if mxfp4.is_expert_weight(name) else w
        return self._read(name, row)

    def _read(self, name: str, row: int | None) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"tensor {name} is not in the checkpoint: is model.path a supported HF model?")
        f = self._handle(self.files[name])
        t = f.get_tensor(name) if row is None else f.get_slice(name)[row]
        return self._count(name, row, t).to(self.device)

    def _handle(self, file: Path):
        """The file's safetensors reader, opened (memory-mapped) once."""
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(str(file), "pt")
        return self._open[file]

    def close(self) -> None:
        super().close()
        self._open.clear()


class SeededSource(_Source):
    """`model.arch`'s initial weights: `shapes` (checkpoint name -> shape, `models.arch_plan`) drawn on
    `device` by `models.initial_tensor` from `seed`, cast to `dtype`."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, seed: int, std: float, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(dtype, device)
        self.shapes, self.seed, self.std = shapes, seed, std

    def _make(self, name: str, row: int | None) -> torch.Tensor:
        from offpolicy.models.build import initial_tensor

        if name not in self.shapes:
            raise KeyError(f"tensor {name} is not a parameter of model.arch")
        t = initial_tensor(name, self.shapes[name], seed=self.seed, std=self.std, device=self.device, row=row)
        return self._count(name, row, t.to(self.dtype))
