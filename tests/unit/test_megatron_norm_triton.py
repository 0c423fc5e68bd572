"""norms.py's Triton RMSNorm (norms.rms_norm_triton, norm_kernels.py) in Triton's interpreter on the CPU, and which
norms take it.

The kernels against a float64 reference of F.rms_norm's formula (y = x / sqrt(mean(x^2) + eps) w; its autograd for
dx and dw) and against F.rms_norm itself (eps given and eps None, x small enough that eps counts): float32 and
bf16, widths 2,880, 2,048, 128 and 100 (no power of two: masked columns), several rows a program step (width 128
and 100) and one, programs that take several row blocks with a partial last one (the interpreter runs 3
backward programs), one row, no rows (dw zero), leading dims, rows that are not contiguous, a weight that
wants no gradient. The interpreter rounds float32 to bf16 toward zero (a GPU to nearest), so bf16 outputs are
held to one bf16 ulp here; tests/gpu/test_megatron_norms_gpu.py holds them to torch's rounding on a GPU.
Which norms take it (no Triton needed): a Norm wider than a head with x and weight of one dtype where
moe_triton.available holds; not head norms, LayerNorm, mixed dtypes, nor anything under OFFPOLICY_EAGER_KERNELS=1.
"""

import types

import pytest
import torch

from offpolicy.learner.backends.megatron.kernels import moe_triton, norms
from tests.interpreter import assert_interpreted_ok

CHECK = r"""
import torch
import torch.nn.functional as F
from offpolicy.learner.backends.megatron.kernels import norms

assert norms.triton_runs(torch.zeros(2, 8), torch.zeros(8))
gen = torch.Generator().manual_seed(0)

def reference(x, w, dy, eps):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    return (y.detach(), *torch.autograd.grad(y, (x64, w64), dy.double()))

def close(got, want, dtype, what):
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    if not want.numel():
        return
    scale = float(want.abs().max())
    rtol = 1e-5 if dtype == torch.float32 else 2.0 ** -7  # bf16: one ulp (the interpreter truncates)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5 * scale, msg=what)

def case(shape, dtype, eps=1e-6, scale=1.0, transposed=False):
    width = shape[-1]
    x = (torch.randn(*shape, generator=gen) * scale).to(dtype)
    if transposed:  # rows not contiguous: leading dims swapped
        x = x.transpose(0, 1)
    x.requires_grad_()
    w = (torch.rand(width, generator=gen) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(x.shape, generator=gen).to(dtype)
    y = norms.rms_norm_triton(x, w, eps)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    ref = reference(x.detach(), w.detach(), dy, torch.finfo(torch.float32).eps if eps is None else eps)
    for what, got, want in zip(("y", "dx", "dw"), (y, dx, dw), ref):
        close(got, want, dtype, f"{what} {shape} {dtype}")
    if dtype == torch.float32:  # torch's own op, eps included: the same values and gradients
        t = F.rms_norm(x, (width,), w, eps)
        torch.testing.assert_close(y, t, rtol=1e-5, atol=1e-6)
        for a, b in zip((dx, dw), torch.autograd.grad(t, (x, w), dy)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()) if b.numel() else 0.0)
    return dw

case((20, 10, 100), torch.float32)                    # 200 rows in 32-row steps: 7 blocks over 3 programs
case((7, 2880), torch.float32)                         # GPT-OSS's width: one row a step, masked columns
case((9, 2048), torch.bfloat16)                        # Qwen3's: 2 rows a step, a partial last block
case((5, 3, 2880), torch.bfloat16, transposed=True)
case((1, 2048), torch.bfloat16)                        # one row
case((6, 4, 128), torch.bfloat16)                      # a head norm's shape
case((33, 100), torch.float32, eps=1e-6, scale=1e-3)  # eps as large as mean(x^2)
case((4, 100), torch.float32, eps=None, scale=1e-4)   # eps None: float32's epsilon, as torch's
assert not case((0, 2048), torch.bfloat16).any()      # no rows: dw zero
x = torch.randn(3, 2048, generator=gen).requires_grad_()
w = torch.rand(2048, generator=gen) + 0.5              # a frozen weight: dx only
(dx,) = torch.autograd.grad(norms.rms_norm_triton(x, w, 1e-6), (x,), torch.ones(3, 2048))
close(dx, reference(x.detach(), w, torch.ones(3, 2048), 1e-6)[1], torch.float32, "dx, frozen weight")

cfg = __import__("types").SimpleNamespace(normalization="RMSNorm", params_dtype=torch.bfloat16, sequence_parallel=True)
n = norms.Norm(cfg, 2880, eps=1e-5)                    # the module: its weight's gradient through the kernels
x = torch.randn(3, 2, 2880, generator=gen).to(torch.bfloat16).requires_grad_()
dy = torch.randn(3, 2, 2880, generator=gen).to(torch.bfloat16)
y = n(x)
dx, dw = torch.autograd.grad(y, (x, n.weight), dy)
for what, got, want in zip(("y", "dx", "dw"), (y, dx, dw), reference(x.detach(), n.weight.detach(), dy, 1e-5)):
    close(got, want, torch.bfloat16, "Norm " + what)
print("ok")
"""


def test_kernels_in_the_interpreter_match_rms_norm_and_its_autograd():
    pytest.importorskip("triton")
    assert_interpreted_ok(CHECK)


def test_norms_wider_than_a_head_take_the_kernels_where_they_run(monkeypatch):
    calls = []
    monkeypatch.setattr(norms, "rms_norm_triton", lambda x, w, eps: calls.append((x.shape[-1], eps)) or x)
    monkeypatch.setattr(moe_triton, "available", lambda t: True)

    def norm(width, dtype=torch.bfloat16, kind="RMSNorm"):
        cfg = types.SimpleNamespace(normalization=kind, params_dtype=dtype, sequence_parallel=False)
        return norms.Norm(cfg, width, eps=1e-6)

    x = torch.randn(3, 2048, dtype=torch.bfloat16)
    norm(2048)(x)
    assert calls == [(2048, 1e-6)]
    norm(128)(x[:, :128])                                      # a head norm: compiled or torch's
    norm(2048, torch.float32)(x)                               # mixed dtypes: torch's
    norm(2048, kind="LayerNorm")(x)
    norm(norms.MAX_WIDTH * 2)(torch.randn(1, norms.MAX_WIDTH * 2, dtype=torch.bfloat16))
    assert len(calls) == 1
    monkeypatch.setattr(moe_triton, "available", lambda t: False)  # a CPU tensor, no Triton, or the switch
    norm(2048)(x)
    assert len(calls) == 1


def test_off_switch_leaves_torchs_rms_norm(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w = torch.zeros(2, 512), torch.ones(512)
    monkeypatch.setenv("OFFPOLICY_EAGER_KERNELS", "1")
    assert not norms.triton_runs(x, w)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("OFFPOLICY_EAGER_KERNELS")
    assert not norms.triton_runs(x, w)  # a CPU tensor without the interpreter
