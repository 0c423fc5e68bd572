"""Rows of a tensor at unique indices, whose backward writes each gradient row to its place and never adds.

`torch.index_select`'s backward is an `index_add_` into zeros: atomics (bf16 ones for bf16 activations), which
the GPU serialises where it cannot prove the indices distinct. Where they are distinct by construction,
`select(src, index)` gives the same rows forward and a backward of zeros plus one `index_copy_` (no atomics,
deterministic): the permuted routing probabilities (permutation.py: each row's place in the routing map) and
the hidden states of the response tokens' logits (backend._logprobs: one position per response token, where
index_add's atomics were slow; docs/benchmarks.md).
"""

from __future__ import annotations

import torch


class _Select(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.shape = src.shape
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (index,) = ctx.saved_tensors
        return g.new_zeros(ctx.shape).index_copy_(0, index, g), None


def select(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`src.index_select(0, index)` for `index` without repeats (repeats would keep one gradient, not the sum)."""
    return _Select.apply(src, index)
