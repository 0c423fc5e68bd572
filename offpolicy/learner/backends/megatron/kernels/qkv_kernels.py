"""The attention's q/k/v split, head norms and RoPE as Triton kernels (qkv.py's docstring has the math and the
layout); imported only where Triton is (qkv.fused_runs)."""

import triton
import triton.language as tl


@triton.jit
def _head_rows(rows, G: tl.constexpr, QPG: tl.constexpr):
    """(is q, is k, is v, the row of q / of k and v it is) of head rows of the fused projection's output."""
    j = rows % (QPG + 2)
    grp = (rows // (QPG + 2)) % G
    tok = rows // ((QPG + 2) * G)
    return j < QPG, j == QPG, j == QPG + 1, tok * (G * QPG) + grp * QPG + j, tok * G + grp, tok


@triton.jit
def qkv_forward(x_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, R, B, eps, G: tl.constexpr,
                QPG: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr, BR: tl.constexpr,
                BD: tl.constexpr):
    """BR head rows of x [R, D] a program: q and k rows normed (float32, rounded to x's dtype) and rotated by the
    tables of their token (row tok // B), v rows copied; each stored at its place in q, k or v."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    rm, cm, rot = rows < R, cols < D, cols < ROT
    m = rm[:, None] & cm[None, :]
    is_q, is_k, is_v, qrow, krow, tok = _head_rows(rows, G, QPG)
    half: tl.constexpr = ROT // 2
    pc = tl.where(cols < half, cols + half, cols - half)  # the rotation's partner column
    mp = rm[:, None] & rot[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + rows[:, None] * D + pc[None, :], mask=mp, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.where(is_q[:, None], tl.load(qw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :],
                     tl.load(kw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :])
        wp = tl.where(is_q[:, None], tl.load(qw_ptr + pc, mask=rot, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + pc, mask=rot, other=0.0).to(tl.float32)[None, :])
        y = (x * r[:, None] * w).to(x_ptr.dtype.element_ty).to(tl.float32)  # the norm's output, as torch rounds it
        yp = (xp * r[:, None] * wp).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        y, yp = x, xp
    trow = (tok // B)[:, None] * ROT + cols[None, :]
    c = tl.load(cos_ptr + trow, mask=mp, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + trow, mask=mp, other=0.0).to(tl.float32)
    sign = tl.where(cols < half, -1.0, 1.0)[None, :]  # rotate_half: (-x2, x1)
    o = tl.where(rot[None, :], y * c + sign * yp * s, y)
    o = tl.where(is_v[:, None], x, o).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + qrow[:, None] * D + cols[None, :], o, mask=m & is_q[:, None])
    tl.store(k_ptr + krow[:, None] * D + cols[None, :], o, mask=m & is_k[:, None])
    tl.store(v_ptr + krow[:, None] * D + cols[None, :], o, mask=m & is_v[:, None])


@triton.jit
def qkv_backward(x_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, dq_ptr, dk_ptr, dv_ptr, dx_ptr, dw_ptr, R, B, eps,
                 G: tl.constexpr, QPG: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
                 BR: tl.constexpr, BD: tl.constexpr):
    """dx [R, D] of every BR-row block b = pid, pid + programs, ...: the rotation's transpose, then the norm's
    backward (x re-read, rstd recomputed); this program's float32 sums of dy x_hat over its q rows and its k rows
    into dw_ptr [programs, 2, D]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cm, rot = cols < D, cols < ROT
    half: tl.constexpr = ROT // 2
    pc = tl.where(cols < half, cols + half, cols - half)
    sign = tl.where(cols < half, 1.0, -1.0)[None, :]  # d < half: + dout[d + half] s[d + half]
    wq = tl.load(qw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    wk = tl.load(kw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    acc_q = tl.zeros([BR, BD], dtype=tl.float32)
    acc_k = tl.zeros([BR, BD], dtype=tl.float32)
    for b in range(pid, tl.cdiv(R, BR), tl.num_programs(0)):
        rows = (b * BR + tl.arange(0, BR)).to(tl.int64)
        rm = rows < R
        m = rm[:, None] & cm[None, :]
        mp = rm[:, None] & rot[None, :]
        is_q, is_k, is_v, qrow, krow, tok = _head_rows(rows, G, QPG)
        mq, mk, mv = m & is_q[:, None], m & is_k[:, None], m & is_v[:, None]
        at_q, at_k = qrow[:, None] * D, krow[:, None] * D
        do = (tl.load(dq_ptr + at_q + cols[None, :], mask=mq, other=0.0).to(tl.float32)
              + tl.load(dk_ptr + at_k + cols[None, :], mask=mk, other=0.0).to(tl.float32))
        dop = (tl.load(dq_ptr + at_q + pc[None, :], mask=mq & rot[None, :], other=0.0).to(tl.float32)
               + tl.load(dk_ptr + at_k + pc[None, :], mask=mk & rot[None, :], other=0.0).to(tl.float32))
        trow = (tok // B)[:, None] * ROT
        c = tl.load(cos_ptr + trow + cols[None, :], mask=mp, other=0.0).to(tl.float32)
        sp = tl.load(sin_ptr + trow + pc[None, :], mask=mp, other=0.0).to(tl.float32)
        dy = tl.where(rot[None, :], do * c + sign * dop * sp, do)
        if HAS_NORM:
            at = rows[:, None] * D + cols[None, :]
            x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            xh = x * r[:, None]
            g = dy * tl.where(is_q[:, None], wq, wk)
            cc = tl.sum(xh * g, axis=1) / D
            dx = (g - xh * cc[:, None]) * r[:, None]
            acc_q += tl.where(is_q[:, None], dy * xh, 0.0)
            acc_k += tl.where(is_k[:, None], dy * xh, 0.0)
        else:
            dx = dy
        dx = tl.where(is_v[:, None], tl.load(dv_ptr + at_k + cols[None, :], mask=mv, other=0.0).to(tl.float32), dx)
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * 2 * D + cols, tl.sum(acc_q, axis=0), mask=cm)
    tl.store(dw_ptr + pid * 2 * D + D + cols, tl.sum(acc_k, axis=0), mask=cm)
