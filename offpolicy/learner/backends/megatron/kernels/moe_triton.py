"""The MoE layer's memory-bound passes as Triton kernels: what the grouped experts' GLU (`experts.glu_rows`) and
the gather permutation's sums of a token's copies (`permutation.gathered_sum`) run on a GPU.

GLU (`glu_rows`). It sits between fc1's and fc2's grouped GEMMs (experts.py has the math):
    g, u = the halves of h [T, 2I] plus fc1's bias of each row's expert (`rows` [T]), in float32
    g = min(g, limit); u = clamp(u, -limit, limit);  a = g sigmoid(alpha g) (u + offset) p_t   [T, I]
The forward reads h and writes a, the backward reads h and a's gradient and writes h's gradient [T, 2I]
and p's [T]. torch.compile's backward took several times its bytes' time (docs/benchmarks.md): inductor split it into a pointwise kernel that wrote the two
halves as a "cat", reading the inputs once per half, and a reduction that read them all again for p's
gradient. Here each way is one pass:
    forward    flat blocks of BLOCK elements of [T, I] (I a compile-time constant, as inductor has it): loads
               both halves (and the biases, indexed by row), stores a
    backward   programs of BT rows looping over I in BI-wide chunks: loads both halves, the biases and a's
               gradient once, stores both halves' gradients and sums p's in registers (one store per row)
Float32 math as the eager function's (the same operations; sigmoid is the GPU's, so values agree with eager to
float32 rounding before the cast back to h's dtype). fc1's bias comes in detached and gets no gradient here
(experts._RowBias sums it from h's gradient).

Gathered sums (`gathered_sum`): out[t] = sum_s rows[inverse[t, s]] of rows [M, H] and indices [N, k], an index
of M or more adding nothing (a token with fewer than k copies; no zero row appended), float32 sums in rows'
dtype. Programs of [BT tokens x BH columns] load each token's k rows in turn. Inductor's kernel for Qwen3's
k = 8 (a persistent reduction over the copies) took several times its bytes' time (docs/benchmarks.md).

`available(t)`: t is a CUDA tensor (or TRITON_INTERPRET=1: Triton's interpreter on a CPU, for the tests)
and Triton imports; `OFFPOLICY_EAGER_KERNELS=1` turns the kernels off (the compiled functions run).
tests/unit/test_megatron_moe_triton.py runs them in the interpreter against the eager functions and their
autograd; tests/gpu/test_megatron_experts_gpu.py and test_megatron_permutation_gpu.py on a GPU;
benchmarks/moe_kernels.py times them against the compiled functions and the bytes' time.
"""

from __future__ import annotations

import functools

import torch

from offpolicy.plumbing import triton_gate

BLOCK_FWD = 1024  # GLU forward: elements of [T, I] per program
BT_BWD, BI_BWD = 4, 256  # GLU backward: rows per program, columns per loop step (benchmarks/moe_kernels.py)
BT_SUM, BH_SUM = 4, 512  # gathered sums: tokens x columns per program
BLOCK_ACC = 2048  # accumulate: elements per program


@functools.cache
def kernels():
    """moe_kernels (the Triton kernels; import only where `available` holds)."""
    from offpolicy.learner.backends.megatron.kernels import moe_kernels

    return moe_kernels


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `t` (module docstring; plumbing/triton_gate.py)."""
    return triton_gate.runs(t.device.type, "OFFPOLICY_EAGER_KERNELS")


def gathered_sum(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_s rows[inverse[t, s]] of `rows` [M, H] and `inverse` [N, k] (indices >= M add nothing);
    float32 sums, rows' dtype. Not differentiable (the permutation's autograd Functions call it)."""
    rows, inverse = rows.contiguous(), inverse.contiguous()
    (n, k), (m, width) = inverse.shape, rows.shape
    out = torch.empty((n, width), dtype=rows.dtype, device=rows.device)
    if n and width:
        grid = (-(-n // BT_SUM), -(-width // BH_SUM))
        kernels().gathered_sum[grid](rows, inverse, out, n, m, width, K=k, BT=BT_SUM, BH=BH_SUM, num_warps=4)
    return out


def accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src in float32, in place: dst float32, src bf16 / fp16 / float32 of dst's shape, both contiguous and on
    one device where `available` holds (grad_accum.runs checks it for megatron's main grads; logprobs' grad_hidden)."""
    n = dst.numel()
    if n:
        kernels().accumulate[(-(-n // BLOCK_ACC),)](dst, src, n, BLOCK=BLOCK_ACC, num_warps=8)


def glu_rows(h: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor | None, probs: torch.Tensor | None,
             alpha: float | None, limit: float | None, offset: float) -> torch.Tensor:
    """`experts.glu_rows` by the Triton kernels: `h` [T, 2I], `bias` [E_l, 2I] (detached) of each row's expert
    `rows` [T], `probs` [T] (None: no row weights, the dense MLP's SwiGLU, glu.SwiGLU); alpha None is SiLU's
    (alpha 1), limit None no clamp. Returns [T, I] in h's dtype, differentiable in h and probs."""
    if bias is not None and bias.requires_grad:
        raise ValueError("moe_triton.glu_rows: fc1's bias must come detached (experts._RowBias sums its gradient)")
    return _Glu.apply(h, bias, rows, probs, 1.0 if alpha is None else float(alpha), limit, float(offset))


class _Glu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, rows, probs, alpha, limit, offset):
        h = h.contiguous()
        T, I = h.shape[0], h.shape[1] // 2
        out = torch.empty((T, I), dtype=h.dtype, device=h.device)
        if T:
            k, args = kernels(), _args(h, bias, rows, probs, alpha, limit, offset)
            grid = (-(-T * I // BLOCK_FWD),)
            k.glu_forward[grid](h, *args[:3], out, T * I, *args[3:], I=I, BLOCK=BLOCK_FWD, num_warps=4)
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
            k, args = kernels(), _args(h, bias, rows, probs, *ctx.consts)
            k.glu_backward[(-(-T // BT_BWD),)](h, *args[:3], grad, grad_h, grad_p, T, *args[3:], I=I, NEED_P=need_p,
                                               BT=BT_BWD, BI=BI_BWD, num_warps=4)
        return grad_h, None, None, grad_p.to(probs.dtype) if need_p else None, None, None, None


def _args(h, bias, rows, probs, alpha, limit, offset) -> tuple:
    """The kernels' shared arguments: bias, rows, probs (h itself where absent: never read), then the strides
    and constants."""
    has_bias = bias is not None
    if has_bias and (rows is None or rows.shape[0] != h.shape[0]):
        raise ValueError("moe_triton: a bias needs `rows`, one local expert per row of h")
    if probs is not None and probs.shape != (h.shape[0],):
        raise ValueError(f"moe_triton: probs has shape {tuple(probs.shape)}, want ({h.shape[0]},)")
    bias = bias.contiguous() if has_bias else h
    return (bias, rows if has_bias else h, h if probs is None else probs.contiguous(), h.stride(0), bias.stride(0),
            alpha, 0.0 if limit is None else float(limit), offset, has_bias, limit is not None, probs is not None)
