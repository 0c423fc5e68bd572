"""The learner's RMSNorm as Triton kernels (norms.py's docstring has the math and tiles); imported only where
Triton is (norms.triton_runs)."""

import triton
import triton.language as tl


@triton.jit
def rms_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, M, eps, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """y = x rstd w of BM rows [M, N] a program, rstd = 1 / sqrt(mean(x^2) + eps) per row; float32 math."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    rm = rows < M
    m = rm[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(rstd_ptr + rows, r, mask=rm)
    tl.store(y_ptr + at, (x * r[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def rms_backward(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, M, N: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr):
    """dx of every BM-row block b = pid, pid + programs, ...; this program's float32 sum of dy x_hat over its
    rows into row pid of dw_ptr [programs, N]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    cm = cols < N
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for b in range(pid, tl.cdiv(M, BM), tl.num_programs(0)):
        rows = (b * BM + tl.arange(0, BM)).to(tl.int64)
        rm = rows < M
        m = rm[:, None] & cm[None, :]
        at = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + at, mask=m, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows, mask=rm, other=0.0)
        xh = x * r[:, None]
        g = dy * w[None, :]  # the gradient of x_hat
        c = tl.sum(xh * g, axis=1) / N
        tl.store(dx_ptr + at, ((g - xh * c[:, None]) * r[:, None]).to(dx_ptr.dtype.element_ty), mask=m)
        acc += dy * xh
    tl.store(dw_ptr + pid * N + cols, tl.sum(acc, axis=0), mask=cm)
