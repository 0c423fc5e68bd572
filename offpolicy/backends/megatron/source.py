"""Full HF tensors by name for the Megatron loader: a safetensors directory (lazily) or a state dict.

`HFSource.get(name, row=None)` returns tensor `name` of the checkpoint, or only `name[row]` (one
expert of a fused tensor), read alone from its safetensors file. An MXFP4 checkpoint
(`config.json` `quantization_config.quant_method: mxfp4`, GPT-OSS's release format) stores expert
weights as `<name>_blocks` (uint8 e2m1 pairs) + `<name>_scales` (e8m0) over their transpose; asking for
`<name>` dequantizes them (`offpolicy.weights.mxfp4`) to `dtype`, the configured training dtype, in
the bf16 checkpoint's layout (`GptOssExperts`' `[E, in, out]`; one `row` = one expert, `[in, out]`),
so the learner trains a bf16/fp32 copy of the released weights. Other quantized checkpoints are refused
with the field and the fix. Invariant: for an MXFP4 directory, get(name)[e] == get(name, row=e) ==
mxfp4.dequantize(blocks[e], scales[e]).T exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class HFSource:
    def __init__(self, path: str | None = None, state: dict[str, torch.Tensor] | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        self.state, self.files, self.dtype, self.mxfp4 = state, {}, dtype, False  # state: checkpoint names
        if path is None:
            return
        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            single = root / "model.safetensors"
            with safe_open(str(single), "pt") as f:
                self.files = {k: single for k in f.keys()}
        qc = json.loads((root / "config.json").read_text()).get("quantization_config") or {}
        method = qc.get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"model.path {path}: config.json quantization_config quant_method {method!r} is not "
                             "read by learner.backend=megatron (only mxfp4 is); give model.path a bf16 checkpoint")
        self.mxfp4 = method == "mxfp4"

    def get(self, name: str, row: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only `name[row]`; MXFP4 pairs dequantized to `self.dtype`."""
        if self.state is not None:
            t = self.state[name]
            return t if row is None else t[row]
        if name not in self.files and self.mxfp4 and name + "_blocks" in self.files:
            from offpolicy.weights import mxfp4

            w = mxfp4.dequantize(self._read(name + "_blocks", row), self._read(name + "_scales", row), self.dtype)
            return w.transpose(-1, -2).contiguous() if mxfp4.is_expert_weight(name) else w
        return self._read(name, row)

    def _read(self, name: str, row: int | None) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"tensor {name} is not in the checkpoint: is model.path a supported HF model?")
        with safe_open(str(self.files[name]), "pt") as f:
            return f.get_tensor(name) if row is None else f.get_slice(name)[row]
