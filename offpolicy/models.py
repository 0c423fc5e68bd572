"""Model construction for the embedded engine and learner: HF `transformers` causal LMs.

`build_model` loads `model.path` with `from_pretrained`, or builds `model.arch` (an HF config.json
mapping with `model_type`) from scratch with a fixed seed, so every daemon starts from identical
weights without a download. `from_pretrained` loads an MXFP4 checkpoint (GPT-OSS's release format,
`quantization_config.quant_method: mxfp4`) dequantized to the requested dtype (transformers'
`Mxfp4Config(dequantize=True)`): the learner trains, and the torch engine samples, at that precision,
whatever kernels the machine has. `hf_state` yields the (name, tensor) pairs the weight store publishes,
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
        model = from_pretrained(source, dtype)
    else:
        arch = dict(cfg.arch)
        hf_cfg = AutoConfig.for_model(arch.pop("model_type"), **arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return model.to(device).eval()


def from_pretrained(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained(path)` in `dtype`, an MXFP4 checkpoint dequantized to it."""
    from transformers import AutoModelForCausalLM

    from offpolicy.weights.formats import checkpoint_format

    extra = {}
    if checkpoint_format(path) == "mxfp4":  # else transformers keeps MXFP4 (not trainable) where triton runs it
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    if extra and dtype != torch.bfloat16:
        # transformers 5.19 dequantizes MXFP4 experts to bf16 whatever `dtype` says (on CPU without kernels):
        # cast them up (exactly: every MXFP4 value is a bf16 value) so the model trains and samples in `dtype`
        for param in model.parameters():
            if param.dtype == torch.bfloat16:
                param.data = param.data.to(dtype)
    return model


_PER_EXPERT_CHECKPOINTS = {"qwen2_moe", "qwen3_moe"}  # families whose checkpoints name each expert's weights


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the names of its HF checkpoint (what `from_pretrained`, SGLang and the
    megatron backend read and write). transformers 5 keeps a layer's MoE experts fused in memory
    (`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `mlp.experts.down_proj` [E, H, I]);
    the checkpoint names each expert (`mlp.experts.{e}.gate_proj.weight`, ...). Those come out as views
    into the fused parameters, so reading a version into them loads the model in place."""
    split = getattr(model.config, "model_type", None) in _PER_EXPERT_CHECKPOINTS
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if not (split and base.endswith(".mlp.experts") and leaf in ("gate_up_proj", "down_proj") and t.dim() == 3):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if leaf == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
    return out


def hf_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-named parameters and buffers worth saving (`checkpoint_tensors`), tied weights once."""
    seen: set[tuple[int, int]] = set()
    for name, t in checkpoint_tensors(model).items():
        key = (t.data_ptr(), t.numel())
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
