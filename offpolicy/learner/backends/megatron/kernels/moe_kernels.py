"""The Megatron learner's Triton kernels (moe_triton.py's and grad_accum.py's docstrings have the math and tiles);
imported only where Triton is."""

import triton
import triton.language as tl


@triton.jit
def _gated(g, u, alpha, limit, HAS_LIMIT: tl.constexpr):
    """The clamped halves and act(g) = g sigmoid(alpha g), float32: (g, u, s, act)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(g * alpha)
    return g, u, s, g * s


@triton.jit
def glu_forward(h_ptr, b_ptr, rows_ptr, p_ptr, out_ptr, N, stride_h, stride_b, alpha, limit, offset,
                HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_P: tl.constexpr, I: tl.constexpr,
                BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < N
    t = idx // I
    i = idx % I
    at = h_ptr + t * stride_h + i
    g = tl.load(at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(at + I, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        r = tl.load(rows_ptr + t, mask=m, other=0).to(tl.int64)
        bat = b_ptr + r * stride_b + i
        g += tl.load(bat, mask=m, other=0.0).to(tl.float32)
        u += tl.load(bat + I, mask=m, other=0.0).to(tl.float32)
    g, u, s, act = _gated(g, u, alpha, limit, HAS_LIMIT)
    a = act * (u + offset)
    if HAS_P:
        a = a * tl.load(p_ptr + t, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, a.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def glu_backward(h_ptr, b_ptr, rows_ptr, p_ptr, go_ptr, gh_ptr, gp_ptr, T, stride_h, stride_b, alpha, limit,
                 offset, HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_P: tl.constexpr, I: tl.constexpr,
                 NEED_P: tl.constexpr, BT: tl.constexpr, BI: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    tm = t < T
    if HAS_P:
        p = tl.load(p_ptr + t, mask=tm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        r = tl.load(rows_ptr + t, mask=tm, other=0).to(tl.int64)
    acc = tl.zeros([BT], dtype=tl.float32)
    for i0 in range(0, I, BI):
        i = i0 + tl.arange(0, BI)
        m = tm[:, None] & (i < I)[None, :]
        at = h_ptr + t[:, None] * stride_h + i[None, :]
        g0 = tl.load(at, mask=m, other=0.0).to(tl.float32)
        u0 = tl.load(at + I, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bat = b_ptr + r[:, None] * stride_b + i[None, :]
            g0 += tl.load(bat, mask=m, other=0.0).to(tl.float32)
            u0 += tl.load(bat + I, mask=m, other=0.0).to(tl.float32)
        go = tl.load(go_ptr + t[:, None] * I + i[None, :], mask=m, other=0.0).to(tl.float32)
        g, u, s, act = _gated(g0, u0, alpha, limit, HAS_LIMIT)
        v = u + offset
        gp = go * p[:, None] if HAS_P else go  # the gradient of act * v
        d_act = gp * v
        d_g = d_act * s + d_act * g * (s * (1.0 - s)) * alpha
        d_u = gp * act
        if HAS_LIMIT:  # the clamps pass the gradient where the value was inside, bounds included (torch's)
            d_g = tl.where(g0 <= limit, d_g, 0.0)
            d_u = tl.where((u0 >= -limit) & (u0 <= limit), d_u, 0.0)
        out = gh_ptr + t[:, None] * (2 * I) + i[None, :]
        tl.store(out, d_g.to(gh_ptr.dtype.element_ty), mask=m)
        tl.store(out + I, d_u.to(gh_ptr.dtype.element_ty), mask=m)
        if NEED_P:
            acc += tl.sum(go * (act * v), axis=1)
    if NEED_P:
        tl.store(gp_ptr + t, acc, mask=tm)


@triton.jit
def gathered_sum(rows_ptr, inv_ptr, out_ptr, N, M, H, K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = t < N
    cm = (c < H)[None, :]
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for s in tl.static_range(K):
        j = tl.load(inv_ptr + t * K + s, mask=tm, other=M).to(tl.int64)
        m = (j < M)[:, None] & cm
        acc += tl.load(rows_ptr + j[:, None] * H + c[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * H + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & cm)


@triton.jit
def accumulate(dst_ptr, src_ptr, N, BLOCK: tl.constexpr):
    """dst (float32) += src, elementwise over N (grad_accum.py)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    d = tl.load(dst_ptr + i, mask=m)
    s = tl.load(src_ptr + i, mask=m).to(tl.float32)
    tl.store(dst_ptr + i, d + s, mask=m)
