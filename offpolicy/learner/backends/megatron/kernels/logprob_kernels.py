"""The chunked logprob's Triton kernels (logprob_triton.py's docstring has the math and tiles); imported only where
Triton is (moe_triton.available)."""

import triton
import triton.language as tl


@triton.jit
def chunk_stats(x_ptr, state_ptr, local_ptr, N, C, c0, temperature, BR: tl.constexpr, BC: tl.constexpr):
    """Folds the chunk x [N, C] (columns c0.. of the vocabulary) into each row's running (m, s, sz, z_tok):
    state [4, N] float32, m the max of z = x / temperature, s = sum exp(z - m), sz = sum exp(z - m) z, z_tok the
    token's z where `local` (the token's column) falls in this chunk."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = r < N
    m = tl.load(state_ptr + r, mask=rm, other=0.0)
    s = tl.load(state_ptr + N + r, mask=rm, other=0.0)
    sz = tl.load(state_ptr + 2 * N + r, mask=rm, other=0.0)
    row = x_ptr + r[:, None] * C
    for c in range(0, C, BC):
        cols = c + tl.arange(0, BC)
        msk = rm[:, None] & (cols < C)[None, :]
        z = tl.load(row + cols[None, :], mask=msk, other=0.0).to(tl.float32) / temperature
        zz = tl.where(msk, z, float("-inf"))
        new = tl.maximum(m, tl.max(zz, axis=1))
        new = tl.where(new == float("-inf"), 0.0, new)  # rows past N only: nothing to scale
        scale = tl.exp(m - new)
        e = tl.exp(zz - new[:, None])
        s = s * scale + tl.sum(e, axis=1)
        sz = sz * scale + tl.sum(e * z, axis=1)
        m = new
    col = tl.load(local_ptr + r, mask=rm, other=-1) - c0
    mine = rm & (col >= 0) & (col < C)
    zt = tl.load(x_ptr + r * C + col, mask=mine, other=0.0).to(tl.float32) / temperature
    tl.store(state_ptr + r, m, mask=rm)
    tl.store(state_ptr + N + r, s, mask=rm)
    tl.store(state_ptr + 2 * N + r, sz, mask=rm)
    tl.store(state_ptr + 3 * N + r, tl.load(state_ptr + 3 * N + r, mask=rm, other=0.0) + zt, mask=mine)


@triton.jit
def chunk_grad(x_ptr, lse_ptr, mean_ptr, gl_ptr, ge_ptr, local_ptr, N, C, c0, temperature, BR: tl.constexpr,
               BC: tl.constexpr):
    """x [N, C] <- d loss / d x, in place, in x's dtype: (1[v = token] g_logp - p g_logp - g_ent p (z - mean_z))
    / temperature, p = exp(z - lse)."""
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rm = r < N
    msk = rm[:, None] & (cols < C)[None, :]
    at = x_ptr + r[:, None] * C + cols[None, :]
    z = tl.load(at, mask=msk, other=0.0).to(tl.float32) / temperature
    lse = tl.load(lse_ptr + r, mask=rm, other=0.0)
    mean = tl.load(mean_ptr + r, mask=rm, other=0.0)
    gl = tl.load(gl_ptr + r, mask=rm, other=0.0)
    ge = tl.load(ge_ptr + r, mask=rm, other=0.0)
    tok = tl.load(local_ptr + r, mask=rm, other=-1) - c0
    p = tl.exp(z - lse[:, None])
    dz = tl.where(cols[None, :] == tok[:, None], gl[:, None], 0.0) - p * gl[:, None]
    dz = dz - ge[:, None] * p * (z - mean[:, None])
    tl.store(at, (dz / temperature).to(x_ptr.dtype.element_ty), mask=msk)
