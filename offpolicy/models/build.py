"""Model construction for the embedded engine and learner: HF `transformers` causal LMs.

`build_model` loads `model.path` with `from_pretrained`, or builds `model.arch` (an HF config.json
mapping with `model_type`) from scratch with its weights drawn by `initial_tensor`: each checkpoint
tensor from a generator seeded by (`model.seed`, its name) and, for a stacked-expert tensor, by each
expert row, so that a Megatron rank can draw only the tensors and expert rows it holds (`arch_plan`
gives every name and shape from a model on the meta device, with no weights) and every layout starts
from the same weights as one process. HF's init scheme: norms 1, biases 0 (the GPT-OSS router's drawn),
every other tensor N(0, initializer_range^2). Invariant: on one device type (a CPU generator on CPU,
CUDA's Philox on a GPU) the same (seed, name, row) gives the same values, bit for bit. `from_pretrained` loads an MXFP4 checkpoint (GPT-OSS's release format,
`quantization_config.quant_method: mxfp4`) dequantized to the requested dtype (transformers'
`Mxfp4Config(dequantize=True)`): the learner trains, and the torch engine samples, at that precision,
whatever kernels the machine has. `hf_state` yields the (name, tensor) pairs the weight store publishes,
skipping tied duplicates the way `save_pretrained` does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from offpolicy.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def build_model(cfg: ModelConfig, device: torch.device, path: str | None = None) -> torch.nn.Module:
    """The causal LM of `cfg` (or of the HF directory `path`, which wins), on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[cfg.dtype]
    matmul_precision(cfg, device)
    source = path or cfg.path
    if source is not None:
        model = from_pretrained(source, dtype)
    else:
        hf_cfg = _auto_config(cfg.arch)
        with torch.device(device), _no_init():
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        model.tie_weights()  # transformers ties them in the init it skipped
        std = initializer_std(model.config)
        with torch.no_grad():
            for name, t in _parameter_tensors(model):
                t.copy_(initial_tensor(name, tuple(t.shape), seed=cfg.seed, std=std, device=t.device))
    for m in model.modules():  # HF's padding_idx leaves the pad token's row untrained; a trained model
        if isinstance(m, torch.nn.Embedding):  # (and the Megatron learner) trains it: SmolLM2's pad is its EOS
            m.padding_idx = None
    return model.to(device).eval()


def matmul_precision(cfg: ModelConfig, device: torch.device) -> str:
    """Set and return this process's float32 matmul precision for a model on `device`: "high" (TF32 tensor
    cores) on a GPU with `model.tf32`, else "highest" (full float32 products)."""
    precision = "high" if device.type == "cuda" and cfg.tf32 else "highest"
    torch.set_float32_matmul_precision(precision)
    return precision


def _auto_config(arch: dict):
    from transformers import AutoConfig

    arch = dict(arch)
    return AutoConfig.for_model(arch.pop("model_type"), **arch)


def _no_init():
    """transformers' context that skips its weight init (its module moved in transformers 5)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def initializer_std(hf_cfg) -> float:
    return float(getattr(hf_cfg, "initializer_range", None) or 0.02)


def _parameter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_state` restricted to parameters (buffers such as rotary tables keep what the model computed)."""
    storages = {_storage(p) for p in model.parameters()}
    return ((n, t) for n, t in hf_state(model) if _storage(t) in storages)


def _storage(t: torch.Tensor) -> int:
    """An id of `t`'s storage, shared by its views and tied copies (also on the meta device)."""
    return t.untyped_storage()._cdata


def arch_plan(cfg: ModelConfig) -> tuple[dict, dict[str, tuple[int, ...]], float]:
    """For `model.arch`: (config.json content, {checkpoint name: shape} of every parameter, init std), from the
    model built on the meta device: no memory, no init."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _no_init():
        model = AutoModelForCausalLM.from_config(_auto_config(cfg.arch))
    model.tie_weights()
    return hf_config(model), {n: tuple(t.shape) for n, t in _parameter_tensors(model)}, initializer_std(model.config)


def model_shapes(cfg: ModelConfig, path: str | None = None) -> dict[str, tuple[int, ...]]:
    """{checkpoint name: shape} of the model (`path`, else model.path: its safetensors headers; model.arch: the
    meta-device build), for choices that depend on its shapes (`weights.fp8_blocks`); {} for a hub id."""
    from offpolicy.weights.fp8_blocks import checkpoint_shapes

    path = path or cfg.path
    return checkpoint_shapes(path) if path is not None else arch_plan(cfg)[1]


def stacked(name: str, ndim: int) -> bool:
    """A tensor of stacked experts (`...mlp.experts.gate_up_proj` [E, ...]): drawn one expert row at a time."""
    return ndim == 3 and ".mlp.experts." in name


def initial_tensor(name: str, shape: tuple[int, ...], *, seed: int, std: float, device: torch.device,
                   row: int | None = None) -> torch.Tensor:
    """Initial float32 value of checkpoint tensor `name` of `shape` (or only its expert `row`), on `device`."""
    if stacked(name, len(shape)) and row is None:
        return torch.stack([initial_tensor(name, shape, seed=seed, std=std, device=device, row=r)
                            for r in range(shape[0])])
    if row is not None:
        if not stacked(name, len(shape)):
            return initial_tensor(name, shape, seed=seed, std=std, device=device)[row]
        shape = shape[1:]
    if "norm" in name and name.endswith("weight"):
        return torch.ones(shape, device=device)
    if name.endswith("bias") and ".router." not in name:
        return torch.zeros(shape, device=device)
    digest = hashlib.blake2b(f"{seed}/{name}/{row}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=g)


def from_pretrained(path: str, dtype: torch.dtype, device: torch.device | None = None) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained(path)` in `dtype`, an MXFP4 checkpoint dequantized to it; with a
    CUDA `device` loaded (and dequantized) there, else on the CPU and moved to `device`."""
    from transformers import AutoModelForCausalLM

    from offpolicy.weights.formats import checkpoint_format

    extra = {}
    if checkpoint_format(path) == "mxfp4":  # else transformers keeps MXFP4 (not trainable) where triton runs it
        from transformers import Mxfp4Config

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    if device is not None and device.type == "cuda":
        extra["device_map"] = str(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    if extra and dtype != torch.bfloat16:
        # transformers 5.19 dequantizes MXFP4 experts to bf16 whatever `dtype` says (on CPU without kernels):
        # cast them up (exactly: every MXFP4 value is a bf16 value) so the model trains and samples in `dtype`
        for param in model.parameters():
            if param.dtype == torch.bfloat16:
                param.data = param.data.to(dtype)
    return model if device is None else model.to(device)


_PER_EXPERT_CHECKPOINTS = {"qwen2_moe", "qwen3_moe"}  # families whose checkpoints name each expert's weights


def checkpoint_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None,
                       ) -> dict[str, torch.Tensor]:
    """The model's tensors under the names of its HF checkpoint (what `from_pretrained`, SGLang and the
    megatron backend read and write). transformers 5 keeps a layer's MoE experts fused in memory
    (`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `mlp.experts.down_proj` [E, H, I]);
    the checkpoint names each expert (`mlp.experts.{e}.gate_proj.weight`, ...). Those come out as views
    into the fused parameters, so reading a version into them loads the model in place. `state` (tensors
    under the model's `state_dict` names, e.g. a second set of buffers of the same shapes) is named the same
    way instead of the model's own."""
    split = getattr(model.config, "model_type", None) in _PER_EXPERT_CHECKPOINTS
    out: dict[str, torch.Tensor] = {}
    for name, t in (model.state_dict() if state is None else state).items():
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
    seen: set[tuple[int, int, int]] = set()
    for name, t in checkpoint_tensors(model).items():
        key = (_storage(t), t.storage_offset(), t.numel())  # the storage itself: meta tensors have no address
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
