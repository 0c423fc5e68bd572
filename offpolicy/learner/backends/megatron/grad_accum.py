"""megatron-core's DDP with its gradient accumulation in one vectorised pass.

megatron-core's DDP adds each parameter's gradient into its float32 `main_grad` in a backward hook
(`main_grad.add_(grad)`). With bf16 gradients that is a mixed-dtype add, which torch runs through its
unrolled, unvectorised elementwise kernel at about half the copy bandwidth (docs/benchmarks.md).
`DistributedDataParallel` here is megatron's with each of those hooks wrapped (`wrap`): where megatron's would
add (a gradient present, not added by a fused path already, no `zero_out_wgrad`), `accumulate` adds it with a
Triton kernel (16-byte loads, float32 math), the parameter is marked added for the length of megatron's hook,
which then skips its own add and does the rest (drops the gradient, marks its bucket ready), and the mark is
cleared again. The sums are bit for bit megatron's (one float32 addition of the same operands). Where Triton
cannot run (a CPU tensor without TRITON_INTERPRET=1, other dtypes, non-contiguous tensors) megatron's add runs;
`OFFPOLICY_EAGER_KERNELS=1` turns it off with the other learner kernels (moe_triton.available).
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel as MegatronDDP

from offpolicy.learner.backends.megatron.kernels import moe_triton

accumulate = moe_triton.accumulate  # dst (float32) += src in place, where `runs(dst, src)` holds


def runs(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `accumulate` takes dst (float32) += src (bf16 / fp16 / float32), else megatron's add runs."""
    return (dst.dtype == torch.float32 and src.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
            and dst.device == src.device and moe_triton.available(dst))


def wrap(hook, param: torch.nn.Parameter):
    """megatron's backward hook of `param`, with its add done by `accumulate` where it would add."""

    def wrapped(*args):
        grad = param.grad
        mine = (grad is not None and not getattr(param, "grad_added_to_main_grad", False)
                and not getattr(param, "zero_out_wgrad", False) and getattr(param, "main_grad", None) is not None
                and runs(param.main_grad, grad))
        if mine:
            accumulate(param.main_grad, grad.data)
            param.grad_added_to_main_grad = True
        try:
            return hook(*args)
        finally:
            if mine:
                param.grad_added_to_main_grad = False

    return wrapped


class DistributedDataParallel(MegatronDDP):
    """megatron-core's DDP whose gradient hooks accumulate with `accumulate` (module docstring)."""

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        return wrap(super()._make_backward_post_hook(param), param)
