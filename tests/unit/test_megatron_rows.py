"""rows.select: index_select's rows forward and, for indices without repeats, its gradient backward (a write of
each row's gradient, no adds), 1-D (the routing probabilities) and 2-D (the response tokens' hidden states)."""

import torch

from offpolicy.learner.backends.megatron.kernels.rows import select


def test_select_equals_index_select_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    for shape in ((50,), (50, 7)):
        src = torch.randn(*shape, generator=g).bfloat16().requires_grad_()
        index = torch.randperm(50, generator=g)[:31]
        grad = torch.randn(31, *shape[1:], generator=g).bfloat16()
        got = select(src, index)
        want = src.index_select(0, index)
        assert torch.equal(got, want)
        (a,) = torch.autograd.grad(got, src, grad)
        (b,) = torch.autograd.grad(want, src, grad)
        assert torch.equal(a, b) and a.dtype == src.dtype
        assert torch.count_nonzero(a.reshape(50, -1).abs().sum(1)) == 31  # untouched rows stay zero
