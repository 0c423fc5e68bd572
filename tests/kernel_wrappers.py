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


# triton_kernels' Hopper value layout, written from its format (`hopper_value.py`'s diagram): every 4 consecutive bytes
# of the permuted, zero-padded data become one little-endian int32 word whose 16-bit halves hold one fp4 of each byte
# (the low nibbles in the low half); byte j's fp4 bits 3, 2, 1, 0 go to these bits of each half
HOPPER_SLOTS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 11, 10, 13))


def hopper_pack(b: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 -> the [...] int32 words of the Hopper value layout."""
    w = torch.zeros(b.shape[:-1], dtype=torch.int64, device=b.device)
    for j, slots in enumerate(HOPPER_SLOTS):
        for half, nibble in ((0, b[..., j].to(torch.int64) & 0xF), (16, b[..., j].to(torch.int64) >> 4)):
            for bit, pos in zip((3, 2, 1, 0), slots):
                w |= ((nibble >> bit) & 1) << (pos + half)
    return (w - ((w >> 31) << 32)).to(torch.int32)  # as signed 32-bit


def hopper_unpack(w: torch.Tensor) -> torch.Tensor:
    """`hopper_pack`'s inverse: [...] int32 words -> [..., 4] uint8."""
    x = w.to(torch.int64) & 0xFFFFFFFF
    out = []
    for slots in HOPPER_SLOTS:
        halves = [sum(((x >> (pos + half)) & 1) << bit for bit, pos in zip((3, 2, 1, 0), slots)) for half in (0, 16)]
        out.append(halves[0] | (halves[1] << 4))
    return torch.stack(out, dim=-1).to(torch.uint8)


class HopperValueLayout:
    """A layout named as triton_kernels' Hopper value layout ("HOPPER_VALUE"), in its bit format: the [E, rows, cols]
    bytes zero-padded to (8, 8) multiples, transposed and reversed (a permutation of bytes, as the real one's tiles),
    then packed 4 bytes a word (`hopper_pack`); held transposed (`mx_axis`: the real layout's `mT` view) with
    `transposed`."""
    name = "HOPPER_VALUE"

    def __init__(self, shape, transposed: bool = False):
        self.shape, self.transposed = tuple(shape), transposed

    def swizzle_data(self, data: torch.Tensor) -> torch.Tensor:
        *lead, r, c = data.shape
        padded = torch.nn.functional.pad(data, (0, -c % 8, 0, -r % 8))
        permuted = padded.transpose(-2, -1).flip(-1).contiguous()
        packed = hopper_pack(permuted.reshape(*permuted.shape[:-1], -1, 4)).view(torch.uint8)
        packed = packed.reshape(permuted.shape)
        return packed.mT if self.transposed else packed

    def unswizzle_data(self, data: torch.Tensor) -> torch.Tensor:
        held = data.mT if self.transposed else data
        raw = hopper_unpack(held.contiguous().view(torch.int32)).reshape(held.shape)
        *_, r, c = self.shape
        return raw.flip(-1).transpose(-2, -1)[..., :r, :c]


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
