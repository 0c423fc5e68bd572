"""Norms for megatron-core's local (non-Transformer-Engine) layer spec that work under sequence parallelism.

The local spec builds its norms with megatron-core's torch-norm wrapper, which refuses
`sequence_parallel` outright: under SP a norm sees only this TP rank's slice of the sequence, so its
weight gradient is a partial sum that must be summed over the TP group, and a plain torch norm does
not ask for that. `Norm` is an RMSNorm / LayerNorm (per `config.normalization`) whose parameters carry
`sequence_parallel = config.sequence_parallel` and the model's `params_dtype` (bf16 weights with bf16
activations take torch's fused RMSNorm kernel; a float32 weight made it fall back to a float32
decomposition that cost ~10% of a step); Megatron's `finalize_model_grads` sums the gradients
of parameters so marked over the TP ranks (the same attribute TE norms and the MoE router set). The
q/k norms (qk-norm attention) are summed over TP by Megatron by name whenever `qk_layernorm` is on:
each rank holds only its heads, with or without SP; marking them too changes nothing.

Head norms (q/k norms: rows as wide as a head, HEAD_WIDTH or fewer) run F.rms_norm through torch.compile
on a GPU (`compile_head_norms`, learner.megatron.compile; the token dim symbolic, a graph per head count):
torch's fused RMSNorm kernel, at its bytes' time for the hidden states' 2,048-wide rows, took ~4x it for
Qwen3's 128-wide q norm rows each way (5.3 ms forward and 7.8 ms backward of a two-layer Qwen3-30B-A3B body
step on an H100, issue 35).

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

from offpolicy.backends.megatron.compiled import tokens_dynamic


HEAD_WIDTH = 256  # a norm this wide or narrower is a head norm (compiled on a GPU)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over x's last dim."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_KERNELS: dict = {"rms": rms_norm}


def compile_head_norms() -> None:
    """torch.compile the head norms' RMSNorm (module docstring); process-wide, idempotent; GPU only."""
    if "compiled" not in _KERNELS:
        _KERNELS.update(rms=torch.compile(rms_norm), compiled=True)


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
            if self.shape[0] <= HEAD_WIDTH and "compiled" in _KERNELS:
                tokens_dynamic(_KERNELS, (x, 0))
                return _KERNELS["rms"](x, self.weight, self.eps)
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


def swap_modules(x, table: dict[type, type]):
    """A copy of a layer / block spec with every module class in `table` replaced by its value
    (`with_norms` here; `model.build` swaps the core attention and the expert linear with it too)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(x, type) and x in table:
        return table[x]
    if isinstance(x, ModuleSpec):
        return dataclasses.replace(x, module=swap_modules(x.module, table),
                                   submodules=swap_modules(x.submodules, table))
    if isinstance(x, functools.partial):  # megatron-core 0.19 wraps some submodules as partial(cls, submodules=...)
        return functools.partial(swap_modules(x.func, table), *(swap_modules(a, table) for a in x.args),
                                 **{k: swap_modules(v, table) for k, v in x.keywords.items()})
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: swap_modules(getattr(x, f.name), table)
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, list):
        return [swap_modules(v, table) for v in x]
    if isinstance(x, tuple):
        return tuple(swap_modules(v, table) for v in x)
    return x


def block_spec(layer_spec, num_layers: int):
    """A block spec of `num_layers` copies of `layer_spec` with `Norm` as the final layernorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=Norm)
