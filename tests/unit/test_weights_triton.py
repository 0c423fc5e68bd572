"""The Triton quantize kernels (offpolicy/weights/triton_quant.py) in Triton's interpreter on the CPU,
against the eager definitions in fp8.py / mxfp4.py: MXFP4 bit for bit (strided expert transposes, a
zero group, outliers, leading dims); fp8 scales bit for bit with edge blocks (the interpreter's own e4m3
cast rounds unlike torch's, so the fp8 codes are checked on a GPU: tests/gpu/test_weight_formats_gpu.py).
Skipped without the `triton` package; the kernels run in a subprocess with TRITON_INTERPRET=1."""

import pytest

from tests.interpreter import assert_interpreted_ok

pytest.importorskip("triton")

CHECK = r"""
import torch
from offpolicy.weights import fp8, mxfp4, triton_quant as tq

assert tq.available(torch.zeros(1))
g = torch.Generator().manual_seed(0)
def weight(*shape):
    w = torch.randn(*shape, generator=g) * 0.02
    w.view(-1)[::37] *= 40
    return w.to(torch.bfloat16)

experts = weight(3, 96, 64)
experts[0, :32, :] = 0  # a zero group in the transposed view
for x in (experts.transpose(1, 2), weight(40, 64), weight(2, 2, 8, 32)):
    b, s = tq.mxfp4_quantize(x)
    be, se = mxfp4._quantize(x)
    assert b.shape == be.shape and s.shape == se.shape, (b.shape, be.shape)
    assert torch.equal(b, be), (b != be).sum()
    assert torch.equal(s, se)
for bad in (float("inf"), float("nan")):
    x = weight(4, 64)
    x[2, 7] = bad
    try:
        tq.mxfp4_quantize(x)
        raise SystemExit("no error on a non-finite weight")
    except ValueError as e:
        assert "inf or nan" in str(e)
a = weight(300, 200)
for block in ((128, 128), (90, 90), (64, 32)):
    q, sc = tq.fp8_quantize(a, *block)
    qe, se = fp8._quantize(a, *block)
    assert q.shape == qe.shape and q.dtype == torch.float8_e4m3fn
    assert torch.equal(sc, se), block
print("ok")
"""


def test_kernels_in_the_interpreter_match_the_eager_definitions():
    assert_interpreted_ok(CHECK)
