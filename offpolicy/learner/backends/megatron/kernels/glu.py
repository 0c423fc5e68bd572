"""The dense MLP's SwiGLU, silu(g) u of fc1's halves [g, u], as an activation module of megatron-core's MLP.

megatron-core's MLP builds `MLPSubmodules.activation_func` and calls it on fc1's whole output [s, b, 2I] when
`TransformerConfig.use_te_activation_func` is set (the name is Transformer Engine's; the MLP takes any module).
`SwiGLU` runs there on a GPU the experts' one-pass Triton GLU (moe_triton.glu_rows without biases or row
weights: alpha 1, no clamp, no offset), float32 math and one rounding to fc1's dtype each way, and keeps fc1's
output for the backward as megatron's fusion does. megatron's own fused path (`bias_activation_fusion`, its
torch.compile'd `swiglu_back`) wrote the two halves' gradients as a "cat" at about twice its bytes' time
(docs/benchmarks.md). Where the Triton kernels do not run (moe_triton.available: a CPU, OFFPOLICY_EAGER_KERNELS=1)
it is megatron's unfused GLU, F.silu(g) * u.

`arch.transformer_config(swiglu_module=True)` sets the config (dense families with the plain SwiGLU only; MoE
layers keep their experts' own GLU) and `with_swiglu(spec)` puts the module into a local layer or block spec
(model.build does both on a GPU with the local spec). No parameters: checkpoints and the HF mapping are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offpolicy.learner.backends.megatron.kernels import moe_triton
from offpolicy.learner.backends.megatron.kernels.norms import swap_modules


class SwiGLU(torch.nn.Module):
    """silu(g) * u of x = [g, u] along the last dim (module docstring)."""

    def __init__(self, config=None, **_unused):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if moe_triton.available(x):
            out = moe_triton.glu_rows(x.reshape(-1, x.shape[-1]), None, None, None, None, None, 0.0)
            return out.view(*x.shape[:-1], x.shape[-1] // 2)
        g, u = torch.chunk(x, 2, dim=-1)
        return F.silu(g) * u


def with_swiglu(spec):
    """A copy of a local layer / block spec whose MLPs build `SwiGLU` as their activation module."""
    from megatron.core.transformer.mlp import MLPSubmodules

    return swap_modules(spec, {}, fields={MLPSubmodules: {"activation_func": SwiGLU}})
