"""The grouped experts' GLU as two Triton kernels: what `experts.glu_rows` runs on a GPU.

The GLU sits between fc1's and fc2's grouped GEMMs (experts.py has the math):
    g, u = the halves of h [T, 2I] plus fc1's bias of each row's expert (`rows` [T]), in float32
    g = min(g, limit); u = clamp(u, -limit, limit);  a = g sigmoid(alpha g) (u + offset) p_t   [T, I]
It is memory-bound: the forward reads h and writes a, the backward reads h and a's gradient and writes
h's gradient [T, 2I] and p's [T]. torch.compile's backward on an H100 took 3.4x its bytes' time (GPT-OSS
body, 250k rows x 2,880: 4.7 + 2.7 ms against 2.2 ms; docs/benchmarks.md, issue 35): inductor split it
into a pointwise kernel that wrote the two halves as a "cat", reading the inputs once per half, and a
reduction that read them all again for p's gradient. Here each way is one pass:
    forward    programs of [BT rows x BI columns]: loads both halves (and the biases, indexed by row), stores a
    backward   programs of BT rows looping over I in BI-wide chunks: loads both halves, the biases and a's
               gradient once, stores both halves' gradients and sums p's in registers (one store per row)
Float32 math as the eager function's (the same operations in the same order; sigmoid and exp are the
GPU's, so values agree with eager to float32 rounding before the cast back to h's dtype). fc1's bias
comes in detached and gets no gradient here (experts._RowBias sums it from h's gradient).

`available(h)`: h is a CUDA tensor (or TRITON_INTERPRET=1: Triton's interpreter on a CPU, for the tests)
and Triton imports; `OFFPOLICY_EAGER_GLU=1` turns the kernels off (the compiled function runs).
tests/unit/test_megatron_glu_triton.py runs them in the interpreter against the eager function and its
autograd; tests/gpu/test_megatron_experts_gpu.py on a GPU; benchmarks/glu_kernels.py times them.
"""

from __future__ import annotations

import functools
import os

import torch

BT_FWD, BI_FWD = 8, 256  # forward tile: rows x columns
BT_BWD, BI_BWD = 8, 256  # backward: rows per program, columns per loop step


@functools.cache
def _triton():
    try:
        from offpolicy.backends.megatron import glu_kernels
    except ImportError:  # no triton
        return None
    return glu_kernels


def available(h: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `h` (module docstring)."""
    if os.environ.get("OFFPOLICY_EAGER_GLU") == "1":
        return False
    return (h.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and _triton() is not None


def glu_rows(h: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor | None, probs: torch.Tensor,
             alpha: float | None, limit: float | None, offset: float) -> torch.Tensor:
    """`experts.glu_rows` by the Triton kernels: `h` [T, 2I], `bias` [E_l, 2I] (detached) of each row's expert
    `rows` [T], `probs` [T]; alpha None is SiLU's (alpha 1), limit None no clamp. Returns [T, I] in h's dtype,
    differentiable in h and probs."""
    if bias is not None and bias.requires_grad:
        raise ValueError("glu_triton.glu_rows: fc1's bias must come detached (experts._RowBias sums its gradient)")
    return _Glu.apply(h, bias, rows, probs, 1.0 if alpha is None else float(alpha), limit, float(offset))


class _Glu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, rows, probs, alpha, limit, offset):
        h = h.contiguous()
        T, I = h.shape[0], h.shape[1] // 2
        out = torch.empty((T, I), dtype=h.dtype, device=h.device)
        if T:
            k, args = _triton(), _args(h, bias, rows, probs, alpha, limit, offset)
            grid = (-(-T // BT_FWD), -(-I // BI_FWD))
            k.forward[grid](h, *args[:3], out, T, I, *args[3:], BT=BT_FWD, BI=BI_FWD, num_warps=4)
        ctx.save_for_backward(h, bias, rows, probs)
        ctx.consts = (alpha, limit, offset)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, bias, rows, probs = ctx.saved_tensors
        grad = grad.contiguous()
        T, I = h.shape[0], h.shape[1] // 2
        grad_h = torch.empty_like(h)
        need_p = ctx.needs_input_grad[3]
        grad_p = torch.empty(T, dtype=torch.float32, device=h.device) if need_p else grad_h
        if T:
            k, args = _triton(), _args(h, bias, rows, probs, *ctx.consts)
            k.backward[(-(-T // BT_BWD),)](h, *args[:3], grad, grad_h, grad_p, T, I, *args[3:], NEED_P=need_p,
                                           BT=BT_BWD, BI=BI_BWD, num_warps=4)
        return grad_h, None, None, grad_p.to(probs.dtype) if need_p else None, None, None, None


def _args(h, bias, rows, probs, alpha, limit, offset) -> tuple:
    """The kernels' shared arguments: bias, rows, probs (h itself where absent: never read), then the strides
    and constants."""
    has_bias = bias is not None
    if has_bias and (rows is None or rows.shape[0] != h.shape[0]):
        raise ValueError("glu_triton: a bias needs `rows`, one local expert per row of h")
    if probs.shape != (h.shape[0],):
        raise ValueError(f"glu_triton: probs has shape {tuple(probs.shape)}, want ({h.shape[0]},)")
    bias = bias.contiguous() if has_bias else h
    return (bias, rows if has_bias else h, probs.contiguous(), h.stride(0), bias.stride(0), alpha,
            0.0 if limit is None else float(limit), offset, has_bias, limit is not None)
