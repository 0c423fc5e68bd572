"""Model construction for the embedded engine and learner: HF `transformers` causal LMs.

`build_model` loads `model.path` with `from_pretrained`, or builds `model.arch` (an HF config.json
mapping with `model_type`) from scratch with a fixed seed, so every daemon starts from identical
weights without a download. `hf_state` yields the (name, tensor) pairs the weight store publishes,
skipping tied duplicates the way `save_pretrained` does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from offpolicy.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def build_model(cfg: ModelConfig, device: torch.device, path: str | None = None) -> torch.nn.Module:
    """The causal LM of `cfg` (or of the HF directory `path`, which wins), on `device`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = _DTYPES[cfg.dtype]
    source = path or cfg.path
    if source is not None:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    else:
        arch = dict(cfg.arch)
        hf_cfg = AutoConfig.for_model(arch.pop("model_type"), **arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return model.to(device).eval()


def hf_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named parameters and buffers worth saving, each storage once (tied weights skipped)."""
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        key = t.untyped_storage().data_ptr()
        if key in seen and t.numel():
            continue
        seen.add(key)
        yield name, t


def hf_config(model: torch.nn.Module) -> dict:
    """The model's config.json content (what `from_pretrained` reads back)."""
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):  # to_dict() holds None for a model built from a config
        cfg["architectures"] = [type(model).__name__]
    return cfg
