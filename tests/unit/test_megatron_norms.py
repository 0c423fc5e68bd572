"""norms.py's compiled head norms on the CPU: a Norm as wide as a head or narrower runs the compiled RMSNorm (the
same values and gradients as F.rms_norm; one graph per head count whatever the token count), a wider one torch's
own; nothing compiles until `compile_head_norms` (aot_eager: no C compiler needed; dynamo's graphs are the same)."""

import functools
import types

import pytest
import torch
import torch.nn.functional as F

from offpolicy.learner.backends.megatron.kernels import norms


def _norm(width: int) -> norms.Norm:
    cfg = types.SimpleNamespace(normalization="RMSNorm", params_dtype=torch.float32, sequence_parallel=False)
    n = norms.Norm(cfg, width, eps=1e-6)
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
    return n


def test_head_norms_compile_once_per_head_count_and_equal_rms_norm(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(norms, "_KERNELS", dict(norms._KERNELS))  # the process-wide kernels stay uncompiled
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    head, wide = _norm(16), _norm(norms.HEAD_WIDTH + 1)
    x = torch.randn(5, 1, 3, 16)
    torch.testing.assert_close(head(x), F.rms_norm(x, (16,), head.weight, 1e-6))  # not compiled yet: torch's
    norms.compile_head_norms()
    norms.compile_head_norms()  # idempotent
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for tokens in (7, 19, 300):
        for heads in (4, 1):  # q's and k's
            x = torch.randn(tokens, 1, heads, 16, requires_grad=True)
            got = head(x)
            want = F.rms_norm(x, (16,), head.weight, 1e-6)
            torch.testing.assert_close(got, want)
            g = torch.randn_like(got)
            a = torch.autograd.grad(got, (x, head.weight), g)
            b = torch.autograd.grad(want, (x, head.weight), g)
            for u, v in zip(a, b):
                torch.testing.assert_close(u, v)
    assert counters["stats"]["unique_graphs"] - before == 2  # one for each head count
    y = torch.randn(6, 1, norms.HEAD_WIDTH + 1)
    torch.testing.assert_close(wide(y), F.rms_norm(y, (norms.HEAD_WIDTH + 1,), wide.weight, 1e-6))
    assert counters["stats"]["unique_graphs"] - before == 2  # a wide norm is torch's own: no graph
    torch._dynamo.reset()
