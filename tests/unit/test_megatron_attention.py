"""The packed core attention (offpolicy/learner/backends/megatron/kernels/attention.py) against megatron-core's own.

On CPU through the test shim, float32, one fresh process per case (tests/fresh_processes.py; megatron's
parallel state is process-global): padded rows and packed documents give megatron-core's unfused
DotProductAttention's outputs and gradients, with grouped-query attention, a sliding window and learnable
sinks (the fields GPT-OSS sets). The flash kernels themselves are held to the same reference on the GPU
(tests/gpu/test_megatron_gpu.py).
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests import fresh_processes  # noqa: E402
from tests.megatron_workers import attention_case, free_port  # noqa: E402


@pytest.mark.parametrize("softmax_type,window,groups", [
    ("vanilla", None, 2),
    ("learnable", (3, 0), 2),
    ("learnable", None, 4),
    ("off-by-one", (2, 0), 1),
], ids=["gqa", "window-sinks", "sinks", "mqa-window-off-by-one"])
def test_matches_megatron_dot_product_attention(softmax_type, window, groups):
    fresh_processes.spawn(attention_case, (free_port(), softmax_type, window, groups))


def test_refuses_what_it_does_not_compute():
    fresh_processes.spawn(attention_refusals, (free_port(),))


def attention_refusals(_rank: int, port: int) -> None:
    from tests.megatron_workers import attention_refusals as body

    body(port)


@pytest.mark.parametrize("window,groups", [(-1, 3), (4, 2), (-1, 1)], ids=["gqa", "window", "mha"])
def test_padded_attention_equals_the_reference(window, groups):
    """The float32 CUDA path (SDPA over padded rows) gives the per-document reference's outputs and gradients."""
    from offpolicy.learner.backends.megatron.kernels.attention import (
        padded_attention,
        padded_rows,
        reference_attention,
    )

    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 30, 29, 12, 3, 30, 18]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    heads, dim = 6, 8
    q = torch.randn(bounds[-1], heads, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(bounds[-1], heads // groups, dim, generator=gen, dtype=torch.float64) for _ in "kv")
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    results = []
    for fn in (padded_attention, reference_attention):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, bounds, 0.3, window)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    rows = padded_rows(lengths)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for row in rows:  # longest first; padding within 25% of the row's real tokens
        assert len(row) * lengths[row[0]] <= 1.25 * sum(lengths[i] for i in row) or len(row) == 1


def test_sink_backward_is_the_gradient_of_sink_scaled(monkeypatch):
    """The sinks' kernels of the flash path (CUDA-only there; the pure functions here, float64): `sink_backward`
    gives autograd's gradients of `sink_scaled` for flash's output and the sinks, and through torch.compile
    (aot_eager: no C compiler needed) both compile once for token counts 7, 30 and 129."""
    import functools

    from torch._dynamo.utils import counters

    from offpolicy.learner.backends.megatron.kernels import attention as A
    from offpolicy.learner.backends.megatron.kernels.compiled import tokens_dynamic

    torch.manual_seed(0)
    for t in (7, 30):
        o, lse = torch.randn(t, 4, 8, dtype=torch.float64, requires_grad=True), torch.randn(4, t, dtype=torch.float64)
        sink, grad = torch.randn(4, dtype=torch.float64, requires_grad=True), torch.randn(t, 4, 8, dtype=torch.float64)
        f = A.sink_scaled(o, lse, sink)
        want_o, want_sink = torch.autograd.grad(f, (o, sink), grad)
        got_o, got_sink = A.sink_backward(grad, f.detach(), lse, sink.detach(), True)
        torch.testing.assert_close(got_o, want_o)
        torch.testing.assert_close(got_sink, want_sink)
        assert A.sink_backward(grad, f.detach(), lse, sink.detach(), False)[1] is None
    monkeypatch.setattr(A, "_KERNELS", dict(A._KERNELS))  # the process-wide kernels stay uncompiled
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    A.compile_sinks()
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # as in the autograd Function's passes
        for t in (7, 30, 129):
            o, lse, sink = torch.randn(t, 4, 8).bfloat16(), torch.randn(4, t), torch.randn(4)
            tokens_dynamic(A._KERNELS, (o, 0), (lse, 1))
            f = A._KERNELS["sink_scaled"](o, lse, sink)
            assert torch.equal(f, A.sink_scaled(o, lse, sink))
            grad = torch.randn(t, 4, 8).bfloat16()
            tokens_dynamic(A._KERNELS, (grad, 0), (f, 0), (lse, 1))
            got = A._KERNELS["sink_backward"](grad, f, lse, sink, True)
            want = A.sink_backward(grad, f, lse, sink, True)
            assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])
    assert counters["stats"]["unique_graphs"] - before == 2  # one graph each
    torch._dynamo.reset()
