"""Norms for megatron-core's local (non-Transformer-Engine) layer spec that work under sequence parallelism.

The local spec builds its norms with megatron-core's torch-norm wrapper, which refuses
`sequence_parallel` outright: under SP a norm sees only this TP rank's slice of the sequence, so its
weight gradient is a partial sum that must be summed over the TP group, and a plain torch norm does
not ask for that. `Norm` is an RMSNorm / LayerNorm (per `config.normalization`) whose parameters carry
`sequence_parallel = config.sequence_parallel` and the model's `params_dtype` (bf16 weights with bf16
activations take torch's fused RMSNorm kernel; a float32 weight made it fall back to a float32
decomposition, slower by a share of the step); Megatron's `finalize_model_grads` sums the gradients
of parameters so marked over the TP ranks (the same attribute TE norms and the MoE router set). The
q/k norms (qk-norm attention) are summed over TP by Megatron by name whenever `qk_layernorm` is on:
each rank holds only its heads, with or without SP; marking them too changes nothing.

Head norms (q/k norms: rows as wide as a head, HEAD_WIDTH or fewer) run F.rms_norm through torch.compile
on a GPU (`compile_head_norms`, learner.megatron.compile; the token dim symbolic, a graph per head count):
torch's fused RMSNorm kernel, at its bytes' time for the hidden states' 2,048-wide rows, took several times it
for Qwen3's 128-wide q norm rows each way (docs/benchmarks.md).

Wider norms (the hidden states') run as two Triton kernels on a GPU (`rms_norm_triton`, norm_kernels.py), where
torch's fused backward took about twice its bytes' time (docs/benchmarks.md): F.rms_norm's own math, float32 throughout and one rounding to x's dtype at the end,
    y = x rstd w,  rstd = 1 / sqrt(mean(x^2) + eps)                                     (x, w in float32)
    dx = (g - x_hat mean(x_hat g)) rstd,  g = dy w,  x_hat = x rstd;  dw = sum over rows of dy x_hat
    forward    programs of [BM rows x the width] (BM = TILE / the width's next power of two, at least 1): one
               read of x, one write of y and of rstd (float32, a row each, kept for the backward)
    backward   BWD_PER_SM programs a multiprocessor (a few in the interpreter), each taking every programs-th
               BM-row block: reads x, dy and rstd once, writes dx, and sums dy x_hat of its rows in registers
               into its row of a [programs, width] float32 partial, summed by torch (dw in w's dtype)
They take x and w of one dtype (bf16, fp16 or float32: F.rms_norm's fused case) and rows up to MAX_WIDTH wide;
`triton_runs` says where they run (moe_triton.available: CUDA or the interpreter, not under
OFFPOLICY_EAGER_KERNELS=1, which leaves F.rms_norm). Head norms keep the compiled path. Tested in the
interpreter (tests/unit/test_megatron_norm_triton.py) and on a GPU (tests/gpu/test_megatron_norms_gpu.py);
benchmarks/moe_kernels.py --norms times them against F.rms_norm and the bytes' time.

`with_norms(spec)` returns a copy of a local layer or block spec with every torch norm replaced by
`Norm` (input_layernorm, pre_mlp_layernorm, q/k_layernorm and, for a block spec, the final
layernorm); `block_spec(layer_spec, num_layers)` wraps a single layer spec into a block spec so the
final layernorm can be given too (GPTModel otherwise picks the wrapper itself). The parameter names
equal the torch norms' (`weight`, and `bias` for LayerNorm), so the HF mapping does not change.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from offpolicy.learner.backends.megatron.kernels import moe_triton
from offpolicy.learner.backends.megatron.kernels.compiled import tokens_dynamic


HEAD_WIDTH = 256  # a norm this wide or narrower is a head norm (compiled on a GPU)
MAX_WIDTH = 8192  # wider rows take F.rms_norm (the Triton kernels hold whole rows in registers)
TILE = 4096  # Triton RMSNorm: elements of [rows x the width's next power of two] a program step
WARPS = 8  # warps a program
BWD_PER_SM = 4  # backward programs a multiprocessor (benchmarks/moe_kernels.py --norm-tiles; chosen without a GPU)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over x's last dim."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_KERNELS: dict = {"rms": rms_norm}


def compile_head_norms() -> None:
    """torch.compile the head norms' RMSNorm (module docstring); process-wide, idempotent; GPU only."""
    if "compiled" not in _KERNELS:
        _KERNELS.update(rms=torch.compile(rms_norm), compiled=True)


def triton_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_triton` takes x and weight (module docstring)."""
    return (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 0 < x.shape[-1] <= MAX_WIDTH and moe_triton.available(x))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """F.rms_norm(x, (width,), weight, eps) by the Triton kernels (`triton_runs` must hold): y in x's dtype,
    differentiable in x and weight (eps None: float32's machine epsilon, as torch's)."""
    return _RMSNorm.apply(x, weight, torch.finfo(torch.float32).eps if eps is None else float(eps))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        width = x.shape[-1]
        x2, weight = x.reshape(-1, width).contiguous(), weight.contiguous()
        rows, (bm, bn) = x2.shape[0], _tile(width)
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _kernels().rms_forward[(-(-rows // bm),)](x2, weight, y, rstd, rows, eps, N=width, BM=bm, BN=bn,
                                                      num_warps=WARPS)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        (rows, width), (bm, bn) = x.shape, _tile(x.shape[1])
        dx = torch.empty_like(x)
        programs = min(-(-rows // bm), backward_programs(x))
        partial = torch.empty((programs, width), dtype=torch.float32, device=x.device)
        if rows:
            _kernels().rms_backward[(programs,)](x, weight, dy.reshape(rows, width).contiguous(), rstd, dx, partial,
                                                 rows, N=width, BM=bm, BN=bn, num_warps=WARPS)
        dw = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(dy.shape), dw, None


def _tile(width: int) -> tuple[int, int]:
    """(rows, columns) of a program step: the width's next power of two, rows filling TILE."""
    bn = 1 << (width - 1).bit_length()
    return max(1, TILE // bn), bn


def backward_programs(x: torch.Tensor) -> int:
    """A persistent backward's programs at most (here and qkv.py's): BWD_PER_SM a multiprocessor on a GPU, 3 in the interpreter."""
    if x.device.type == "cuda":
        return torch.cuda.get_device_properties(x.device).multi_processor_count * BWD_PER_SM
    return 3


def _kernels():
    from offpolicy.learner.backends.megatron.kernels import norm_kernels  # Triton imports wherever triton_runs holds

    return norm_kernels


class Norm(torch.nn.Module):
    """RMSNorm or LayerNorm over the last dimension; parameters marked for the TP grad all-reduce under SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization {config.normalization!r}: only RMSNorm and LayerNorm are supported")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("layernorm_zero_centered_gamma is not supported by the local-spec norm")
        self.rms = config.normalization == "RMSNorm"
        self.shape, self.eps = (hidden_size,), eps
        dtype = getattr(config, "params_dtype", None)  # the model's dtype: F.rms_norm fuses only when it matches
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            if self.shape[0] <= HEAD_WIDTH:
                if "compiled" in _KERNELS:
                    tokens_dynamic(_KERNELS, (x, 0))
                    return _KERNELS["rms"](x, self.weight, self.eps)
            elif triton_runs(x, self.weight):
                return rms_norm_triton(x, self.weight, self.eps)
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{'RMSNorm' if self.rms else 'LayerNorm'}({self.shape[0]}, eps={self.eps})"


def _torch_norms() -> tuple[type, ...]:
    """The norm classes megatron-core's local spec may use (its torch wrapper; Apex's when installed)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    found: list[type] = [WrappedTorchNorm]
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    except ImportError:
        pass
    else:
        found.append(FusedLayerNorm)
    return tuple(found)


def with_norms(spec):
    """A copy of a local layer / block spec whose torch norms are `Norm` (other modules untouched)."""
    return swap_modules(spec, {t: Norm for t in _torch_norms()})


def swap_modules(x, table: dict[type, type], fields: dict[type, dict] | None = None):
    """A copy of a layer / block spec with every module class in `table` replaced by its value
    (`with_norms` here; `model.build` swaps the core attention and the expert linear with it too), and in every
    dataclass of a type in `fields` those fields set (glu.with_swiglu: the MLPs' activation module)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def swap(v):
        return swap_modules(v, table, fields)

    if isinstance(x, type) and x in table:
        return table[x]
    if isinstance(x, ModuleSpec):
        return dataclasses.replace(x, module=swap(x.module), submodules=swap(x.submodules))
    if isinstance(x, functools.partial):  # megatron-core 0.19 wraps some submodules as partial(cls, submodules=...)
        return functools.partial(swap(x.func), *(swap(a) for a in x.args),
                                 **{k: swap(v) for k, v in x.keywords.items()})
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = dataclasses.replace(x, **{f.name: swap(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init})
        return dataclasses.replace(out, **fields[type(x)]) if fields and type(x) in fields else out
    if isinstance(x, list):
        return [swap(v) for v in x]
    if isinstance(x, tuple):
        return tuple(swap(v) for v in x)
    return x


def block_spec(layer_spec, num_layers: int):
    """A block spec of `num_layers` copies of `layer_spec` with `Norm` as the final layernorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=Norm)
