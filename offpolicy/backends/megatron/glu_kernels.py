"""The Triton kernels of glu_triton.py (its docstring has the math and the tiles); imported only where Triton is."""

import triton
import triton.language as tl


@triton.jit
def _load(h_ptr, b_ptr, r, t, i, m, I, stride_h, stride_b, HAS_BIAS: tl.constexpr):
    """The float32 halves g, u of rows t, columns i, plus the bias of each row's expert r."""
    at = h_ptr + t[:, None] * stride_h + i[None, :]
    g = tl.load(at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(at + I, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bat = b_ptr + r[:, None] * stride_b + i[None, :]
        g += tl.load(bat, mask=m, other=0.0).to(tl.float32)
        u += tl.load(bat + I, mask=m, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _rows(rows_ptr, p_ptr, t, tm, HAS_BIAS: tl.constexpr):
    """Each row's expert (0 without biases) and probability, float32."""
    p = tl.load(p_ptr + t, mask=tm, other=0.0).to(tl.float32)
    r = t * 0
    if HAS_BIAS:
        r = tl.load(rows_ptr + t, mask=tm, other=0).to(tl.int64)
    return r, p


@triton.jit
def forward(h_ptr, b_ptr, rows_ptr, p_ptr, out_ptr, T, I, stride_h, stride_b, alpha, limit, offset,
            HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, BT: tl.constexpr, BI: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    tm = t < T
    m = tm[:, None] & (i < I)[None, :]
    r, p = _rows(rows_ptr, p_ptr, t, tm, HAS_BIAS)
    g, u = _load(h_ptr, b_ptr, r, t, i, m, I, stride_h, stride_b, HAS_BIAS)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g * tl.sigmoid(g * alpha) * (u + offset) * p[:, None]
    tl.store(out_ptr + t[:, None] * I + i[None, :], a.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def backward(h_ptr, b_ptr, rows_ptr, p_ptr, go_ptr, gh_ptr, gp_ptr, T, I, stride_h, stride_b, alpha, limit,
             offset, HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, NEED_P: tl.constexpr, BT: tl.constexpr,
             BI: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    tm = t < T
    r, p = _rows(rows_ptr, p_ptr, t, tm, HAS_BIAS)
    acc = tl.zeros([BT], dtype=tl.float32)
    for i0 in range(0, I, BI):
        i = i0 + tl.arange(0, BI)
        m = tm[:, None] & (i < I)[None, :]
        g, u = _load(h_ptr, b_ptr, r, t, i, m, I, stride_h, stride_b, HAS_BIAS)
        go = tl.load(go_ptr + t[:, None] * I + i[None, :], mask=m, other=0.0).to(tl.float32)
        g0, u0 = g, u
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(g * alpha)
        act = g * s
        v = u + offset
        gp = go * p[:, None]  # the gradient of act * v
        d_act = gp * v
        d_g = d_act * s + d_act * g * (s * (1.0 - s)) * alpha
        d_u = gp * act
        if HAS_LIMIT:  # the clamps pass the gradient where the value was inside, bounds included (torch's)
            d_g = tl.where(g0 <= limit, d_g, 0.0)
            d_u = tl.where((u0 >= -limit) & (u0 <= limit), d_u, 0.0)
        at = gh_ptr + t[:, None] * (2 * I) + i[None, :]
        tl.store(at, d_g.to(gh_ptr.dtype.element_ty), mask=m)
        tl.store(at + I, d_u.to(gh_ptr.dtype.element_ty), mask=m)
        if NEED_P:
            acc += tl.sum(go * (act * v), axis=1)
    if NEED_P:
        tl.store(gp_ptr + t, acc, mask=tm)

