"""megatron-core's gradient-norm clipping without Apex or Transformer Engine, in one pass and no host syncs.

Without Apex or TE, megatron-core's clip_grads module falls back to megatron.core.utils' local functions:
    norm    `local_multi_tensor_l2_norm`: a `torch.norm` per gradient, then `torch.tensor` of those norms:
            a host synchronisation per parameter
    scale   `local_multi_tensor_scale`: `dst.copy_(src * scale)` per gradient: a product and a copy, two
            passes over every float32 gradient (docs/benchmarks.md)
`install()` puts in their place (process-wide, idempotent; only where the fallbacks are in use):
    norm    `torch._foreach_norm` over the gradients and the norm of those norms, on the device: one float32
            tensor [1] as the fallback returns, no synchronisation (megatron reads it after its all-reduce)
    scale   `torch._foreach_mul_` in place where the sources are the destinations (the clip's call, `[grads,
            grads]`): one pass; any other call goes to megatron's own function
The scale gives the same bits (a float32 product either way); the norm agrees to float32 rounding (its sums run
in another order). tests/unit/test_megatron_clip.py checks both against megatron's fallbacks.
"""

from __future__ import annotations

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's `l2_norm_impl` signature: (the 2-norm of every tensor of tensor_lists[0] together [1], None)."""
    if per_tensor:
        from megatron.core.utils import local_multi_tensor_l2_norm

        return local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        dev = tensor_lists[0][0].device if tensor_lists[0] else "cuda"
        return torch.zeros(1, dtype=torch.float, device=dev), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """megatron's `multi_tensor_scale_impl` signature: dst = src * factor, in place when they are the same."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if len(src) == len(dst) and all(a is b for a, b in zip(src, dst)):
        if dst:
            torch._foreach_mul_(list(dst), factor)
        return
    from megatron.core.utils import local_multi_tensor_scale

    local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, factor)


def install() -> bool:
    """Replace megatron-core's local (no Apex, no TE) norm and scale functions in its clip_grads module; returns
    whether it did (False where Apex or TE kernels are in use: they are one pass already)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    done = False
    if clip_grads.l2_norm_impl in (utils.local_multi_tensor_l2_norm, l2_norm):
        clip_grads.l2_norm_impl, done = l2_norm, True
    if clip_grads.multi_tensor_scale_impl in (utils.local_multi_tensor_scale, scale):
        clip_grads.multi_tensor_scale_impl, done = scale, True
    return done
