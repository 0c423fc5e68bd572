"""The MoE layer's Triton kernels (offpolicy/learner/backends/megatron/kernels/moe_triton.py) in Triton's interpreter on the
CPU. The GLU against experts.glu_rows and its autograd: output, h's gradient (both clamp masks, bounds
included) and the probabilities' gradient; GPT-OSS's clamped form with per-row expert biases and Qwen3's plain
SwiGLU; widths that are no multiple of the column tile, row counts no multiple of the row tile, no rows at all,
no probability gradient asked. The gathered sums against permutation.gathered_sum: k = 4 and 8, tokens with
fewer than k copies (indices past the rows), widths no multiple of the tile, float32 and bf16. Skipped without the `triton` package; the kernels run in a subprocess with
TRITON_INTERPRET=1 (set before Triton is imported). The GPU's own run: tests/gpu/test_megatron_experts_gpu.py."""

import pytest

from tests.interpreter import assert_interpreted_ok

pytest.importorskip("triton")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

CHECK = r"""
import torch
from offpolicy.learner.backends.megatron.kernels import experts, moe_triton as gt

assert gt.available(torch.zeros(1))
gen = torch.Generator().manual_seed(0)

def case(T, I, E, dtype, bias_on, limit, alpha, offset, need_p=True):
    h = (torch.randn(T, 2 * I, generator=gen) * 4).to(dtype)
    if limit is not None and T:  # values on the clamps' bounds: the gradient passes there (torch's clamp)
        h[0, :3] = torch.tensor([limit, -limit, limit - 1], dtype=dtype)
        h[0, I:I + 3] = torch.tensor([limit, -limit, limit + 1], dtype=dtype)
    h.requires_grad_()
    b = torch.randn(E, 2 * I, generator=gen).to(dtype) if bias_on else None
    if bias_on and limit is not None:
        b[:, :3] = b[:, I:I + 3] = 0
    rows = torch.sort(torch.randint(0, E, (T,), generator=gen)).values if bias_on else None
    p = torch.rand(T, generator=gen).requires_grad_(need_p)
    go = torch.randn(T, I, generator=gen).to(dtype)
    out = gt.glu_rows(h, b, rows, p, alpha, limit, offset)
    want = experts.glu_rows(h, b, rows, p, alpha, limit, offset)
    assert out.dtype == dtype and out.shape == (T, I), (out.dtype, out.shape)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, want, **tol)
    if not T:
        return
    inputs = (h, p) if need_p else (h,)
    got = torch.autograd.grad(out, inputs, go)
    ref = torch.autograd.grad(want, inputs, go)
    torch.testing.assert_close(got[0], ref[0], **tol)
    if limit is not None:  # the bound cases: equal to eager's exactly where it is zero and where it is not
        assert torch.equal(got[0][0, :3] == 0, ref[0][0, :3] == 0) and torch.equal(got[0][0, I:I + 3] == 0, ref[0][0, I:I + 3] == 0)
        assert (ref[0][0, [0, 1, I, I + 1]] != 0).all() and (ref[0][0, I + 2] == 0)
    if need_p:
        assert got[1].dtype == p.dtype
        torch.testing.assert_close(got[1], ref[1], atol=1e-3 if dtype == torch.float32 else 0.5, rtol=1e-4 if dtype == torch.float32 else 2e-2)

case(37, 300, 3, torch.float32, True, 7.0, 1.702, 1.0)     # GPT-OSS: clamp, alpha, offset, biases by row
case(16, 64, 1, torch.float32, False, None, None, 0.0)     # Qwen3: SwiGLU
case(21, 96, 4, torch.bfloat16, True, 7.0, 1.702, 1.0)
case(9, 512, 2, torch.bfloat16, False, None, None, 0.0, need_p=False)
case(0, 64, 2, torch.bfloat16, True, 7.0, 1.702, 1.0)      # a rank whose experts got no tokens
try:
    gt.glu_rows(torch.zeros(4, 8), torch.zeros(2, 8, requires_grad=True), torch.zeros(4, dtype=torch.long),
                torch.zeros(4), 1.702, 7.0, 1.0)
    raise SystemExit("a bias that wants a gradient was taken")
except ValueError as e:
    assert "detached" in str(e)
try:
    gt.glu_rows(torch.zeros(4, 8), None, None, torch.zeros(3), None, None, 0.0)
    raise SystemExit("probs of the wrong length were taken")
except ValueError as e:
    assert "probs" in str(e)
from offpolicy.learner.backends.megatron.kernels import permutation

for n, m, width, k, dtype in ((13, 40, 700, 4, torch.float32), (9, 70, 64, 8, torch.bfloat16), (0, 5, 16, 2, torch.float32)):
    rows_ = torch.randn(m, width, generator=gen).to(dtype)
    inverse = torch.randint(0, m, (n, k), generator=gen)
    if n:
        inverse[0, 1:] = m  # a token with one copy
    got = gt.gathered_sum(rows_, inverse)
    want = permutation.gathered_sum(torch.cat([rows_, rows_.new_zeros(1, width)]), inverse)
    assert got.dtype == dtype and got.shape == (n, width)
    torch.testing.assert_close(got, want, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)))
print("ok")
"""


def test_kernels_in_the_interpreter_match_eager_glu_and_its_autograd():
    assert_interpreted_ok(CHECK)


def test_off_switch_and_cpu_tensors_without_the_interpreter(monkeypatch):
    """Without the interpreter a CPU tensor takes the compiled/eager path; OFFPOLICY_EAGER_KERNELS=1 turns the kernels
    off everywhere."""
    import torch

    from offpolicy.learner.backends.megatron.kernels import moe_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not moe_triton.available(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OFFPOLICY_EAGER_KERNELS", "1")
    assert not moe_triton.available(torch.zeros(1))
