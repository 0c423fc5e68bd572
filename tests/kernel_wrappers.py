"""Stand-ins for the kernel tensor wrappers vLLM 0.26's Triton MXFP4 MoE kernels keep GPT-OSS's experts in on Hopper
(triton_kernels' `Tensor`: `.storage.data`, a uint8 torch tensor in a swizzled layout, `.storage.layout` with
`unswizzle_data`): the values as plain attributes of the experts layer, the scales in the quant method's precision
configs (`weight_scale`), the biases widened to float32 Parameters. The stand-in value swizzle swaps every byte's
nibbles and reverses each expert's bytes, so, like the Hopper value layout, it is not a permutation of bytes; the
scale layout is the identity (the real one is a byte permutation plus zero padding). `kept_scales`: SGLang 0.5.14's
MXFP4 MoE on Hopper, which keeps the scales' Parameter (`w13_weight_scale`) beside the precision config's copy."""

from __future__ import annotations

import torch


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    return ((x & 0x0F) << 4) | (x >> 4)


class ValueLayout:
    @staticmethod
    def swizzle(data: torch.Tensor) -> torch.Tensor:
        return _nibbles(data).flip(-1).flip(-2).contiguous()

    def swizzle_data(self, data: torch.Tensor) -> torch.Tensor:  # triton_kernels' Layout API (SGLang's in-place load)
        return self.swizzle(data)

    def unswizzle_data(self, data: torch.Tensor) -> torch.Tensor:
        return _nibbles(data.flip(-1).flip(-2))


class Storage:
    def __init__(self, data: torch.Tensor, layout: object | None = None):
        self.data, self.layout = data, layout


class Wrapped:  # triton_kernels.tensor.Tensor
    def __init__(self, data: torch.Tensor, layout: object | None = None):
        self.storage = Storage(data, layout)


class PrecisionConfig:
    def __init__(self, scales: torch.Tensor):
        self.weight_scale = Wrapped(scales)
        self.flex_ctx = object()  # other kernel state, no tensors


class QuantMethod:
    def __init__(self, scales: torch.Tensor):
        self.w13_precision_config = PrecisionConfig(scales)


class Experts(torch.nn.Module):
    """One MXFP4 experts layer after vLLM's processing, from checkpoint tensors `blocks` (uint8, experts first),
    `scales` (uint8) and `bias` (bf16)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, kept_scales: bool = False):
        super().__init__()
        self.w13_bias = torch.nn.Parameter(bias.float(), requires_grad=False)
        self.w13_weight = Wrapped(ValueLayout.swizzle(blocks), ValueLayout())
        self.quant_method = QuantMethod(scales.clone())
        if kept_scales:
            self.w13_weight_scale = torch.nn.Parameter(scales.clone(), requires_grad=False)


class Model(torch.nn.Module):
    """`layers.<i>.mlp.experts` (the checkpoint's names say `.experts.` too) and a bf16 norm beside it."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], kept_scales: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for blocks, scales, bias in parts:
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = Experts(blocks, scales, bias, kept_scales)
            layer.norm = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16) * 1.5, requires_grad=False)
            self.layers.append(layer)


def checkpoint(seed: int, layers: int = 2, experts: int = 3) -> tuple[list, list[tuple[str, torch.Tensor]]]:
    """Random MXFP4 layer parts and the checkpoint's (name, tensor) list of them (the norms included)."""
    g = torch.Generator().manual_seed(seed)
    parts, files = [], []
    for i in range(layers):
        blocks = torch.randint(0, 256, (experts, 16, 4), dtype=torch.uint8, generator=g)
        scales = torch.randint(100, 140, (experts, 16, 1), dtype=torch.uint8, generator=g)
        bias = torch.randn(experts, 16, generator=g).to(torch.bfloat16)
        parts.append((blocks, scales, bias))
        files += [(f"layers.{i}.mlp.experts.gate_up_proj_blocks", blocks),
                  (f"layers.{i}.mlp.experts.gate_up_proj_scales", scales),
                  (f"layers.{i}.mlp.experts.gate_up_proj_bias", bias),
                  (f"layers.{i}.norm", torch.ones(8, dtype=torch.bfloat16) * 1.5)]
    return parts, files


class GptOss(torch.nn.Module):
    """A GPT-OSS as far as an in-place MXFP4 load goes: per layer `mlp.experts` (`experts(parts)` builds it from the
    checkpoint's tensors of that module, by suffix) and a bf16 router, and the model's own `load_weights` for what is
    not an expert (the engines' loaders: here a copy by name, each name recorded in `loaded`)."""

    def __init__(self, files: dict[str, torch.Tensor], experts, hidden: int, n_experts: int, layers: int = 2):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for i in range(layers):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            prefix = f"model.layers.{i}.mlp.experts."
            layer.mlp.experts = experts({k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix)})
            layer.mlp.router = torch.nn.Linear(hidden, n_experts, dtype=torch.bfloat16)
            self.model.layers.append(layer)
        self.loaded: list[str] = []

    def load_weights(self, named):
        params = dict(self.named_parameters())
        for name, t in named:
            self.loaded.append(name)
            params[name].data.copy_(t)


def gptoss_version(seed: int, experts: int, hidden: int, intermediate: int, rows_cut: int = 0,
                   layers: int = 2) -> dict[str, torch.Tensor]:
    """A random MXFP4 GPT-OSS version's experts and routers (checkpoint names); `rows_cut` rows fewer in gate_up (a
    shape the running model does not hold; negative: more)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        for ckpt, rows, cols in (("gate_up_proj", 2 * intermediate - rows_cut, hidden), ("down_proj", hidden,
                                                                                         intermediate)):
            out[f"{p}experts.{ckpt}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16),
                                                             dtype=torch.uint8, generator=g)
            out[f"{p}experts.{ckpt}_scales"] = torch.randint(110, 130, (experts, rows, cols // 32), dtype=torch.uint8,
                                                             generator=g)
            out[f"{p}experts.{ckpt}_bias"] = torch.randn(experts, rows, generator=g).to(torch.bfloat16)
        out[f"{p}router.weight"] = torch.randn(experts, hidden, generator=g).to(torch.bfloat16)
        out[f"{p}router.bias"] = torch.randn(experts, generator=g).to(torch.bfloat16)
    return out
