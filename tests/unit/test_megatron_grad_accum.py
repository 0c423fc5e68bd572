"""grad_accum.py: the accumulate kernel in Triton's interpreter gives torch's float32 sums bit for bit; the
wrapped DDP hook adds where megatron's would (and megatron's then skips), leaves megatron's add to megatron where
a fused path added already or `zero_out_wgrad` asks for it, and clears its mark; on a CPU tensor without the
interpreter megatron's add runs. The learner itself runs the wrapped DDP in every Megatron test."""

import pytest
import torch

from tests.interpreter import assert_interpreted_ok

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from offpolicy.learner.backends.megatron import grad_accum  # noqa: E402

CHECK = r"""
import torch
from offpolicy.learner.backends.megatron import grad_accum

g = torch.Generator().manual_seed(0)
for n, dtype in ((5000, torch.bfloat16), (2048, torch.float16), (17, torch.float32), (0, torch.bfloat16)):
    dst = torch.randn(n, generator=g) * 3
    src = torch.randn(n, generator=g).to(dtype)
    assert grad_accum.runs(dst, src)
    want = dst.clone().add_(src)
    grad_accum.accumulate(dst, src)
    assert torch.equal(dst, want), n

def megatrons(param):  # megatron's hook, as far as the add goes
    def hook():
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad.data)
        param.grad = None
    return hook

for fused, zero_out in ((False, False), (True, False), (False, True)):
    p = torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))
    p.main_grad = torch.ones(300)
    p.grad_added_to_main_grad = fused
    if zero_out:
        p.zero_out_wgrad = True
    p.grad = torch.full((300,), 2.0).bfloat16()
    grad_accum.wrap(megatrons(p), p)()
    want = 1.0 if fused else 3.0  # a fused path's gradient is in main_grad already: nobody adds
    assert torch.equal(p.main_grad, torch.full((300,), want)), (fused, zero_out, p.main_grad[:3])
    assert p.grad is None and p.grad_added_to_main_grad == fused
print("ok")
"""


def test_kernel_and_hook_in_the_interpreter():
    assert_interpreted_ok(CHECK)


def test_cpu_tensors_take_megatrons_add(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not grad_accum.runs(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.main_grad, p.grad_added_to_main_grad, p.grad = torch.ones(4), False, torch.ones(4).bfloat16()
    calls = []
    grad_accum.wrap(lambda: calls.append(p.grad_added_to_main_grad), p)()
    assert calls == [False] and torch.equal(p.main_grad, torch.ones(4))  # left to megatron's hook
