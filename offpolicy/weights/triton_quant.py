"""Triton kernels of the low-bit quantizers: what `fp8.quantize` and `mxfp4.quantize` run on a GPU.

Quantizing in the publish path is on the learner's critical path: the eager torch functions
(`fp8._quantize`, `mxfp4._quantize`, the format's definition and the CPU path) make a dozen float32
passes over each weight for MXFP4 and launch-bound passes per block grid for fp8, so quantizing, not
copying the smaller output, bounded a low-bit publish (`offpolicy bench weights --formats`, docs/weights.md).
Each kernel here reads the bf16 weight once and writes the quantized bytes and scales once.

They give bit for bit what the eager functions give (tests/gpu/test_weight_formats_gpu.py; on a CPU,
tests/unit/test_weights_triton.py runs them in Triton's interpreter):
- fp8 (`fp8_quantize`): one program per [bn, bk] block (edge blocks masked), amax, `scale = amax / 448`
  and `w / scale` by IEEE division (`div_rn`, as torch's; Triton's `/` is approximate), clamped to
  +-448, cast to e4m3 round-to-nearest-even (`cvt.rn.satfinite`, torch's cast).
- mxfp4 (`mxfp4_quantize`): programs of [rows x groups] tiles of any strided `[B, R, C]` view (the
  GPT-OSS expert path quantizes a transpose, read in place), amax per group of 32, the e8m0 exponent
  from amax's float32 bits (frexp: `exp = biased - 126`, mantissa <= 0.75 iff its fraction bits <=
  0x400000; amax below 2**-126 takes the smallest scale, as frexp + clamp does), `|w| * 2**-e` (a power
  of two: exact), the e2m1 code by the same ties-to-even boundaries, two codes per byte; an inf or nan
  anywhere raises, as the eager path does (one flag the kernel sets, read after it).
  Values below float32's normal range (|w| < 2**-126, never in trained weights) may be flushed to
  zero by the GPU where torch keeps them; their codes are 0 either way unless their whole group is
  that small.

`available(t)`: whether `t` is a CUDA tensor and Triton imports (else the callers run the eager path);
`OFFPOLICY_EAGER_QUANT=1` turns the kernels off (the eager path everywhere), `TRITON_INTERPRET=1` runs
them on a CPU in Triton's interpreter (tests only: its fp8 cast is not torch's).
"""

from __future__ import annotations

import functools

import torch

from offpolicy.plumbing import triton_gate


def available(t: torch.Tensor) -> bool:
    """Whether the kernels quantize `t` (module docstring; plumbing/triton_gate.py)."""
    return triton_gate.runs(t.device.type, "OFFPOLICY_EAGER_QUANT")


def fp8_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`w[rows, cols]` -> (float8_e4m3fn `[rows, cols]`, float32 `[ceil(rows/bn), ceil(cols/bk)]`)."""
    import triton

    k = _kernels()
    rows, cols = w.shape
    nr, nc = -(-rows // bn), -(-cols // bk)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((nr, nc), dtype=torch.float32, device=w.device)
    BN, BK = triton.next_power_of_2(bn), triton.next_power_of_2(bk)
    k.fp8[(nr, nc)](w, q, scale, rows, cols, w.stride(0), w.stride(1), bn, bk, BN=BN, BK=BK,
                    num_warps=8 if BN * BK >= 8192 else 4)
    return q, scale


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w[..., rows, cols]` (cols % 32 == 0, any strides) -> (uint8 `[..., rows, cols/32, 16]`, uint8 `[..., rows, cols/32]`)."""
    import triton

    k = _kernels()
    lead = w.shape[:-2]
    x = w.reshape(-1, *w.shape[-2:]) if w.dim() > 3 else (w if w.dim() == 3 else w.unsqueeze(0))
    b, rows, cols = x.shape
    groups = cols // 32
    blocks = torch.empty((b, rows, groups, 16), dtype=torch.uint8, device=w.device)
    scales = torch.empty((b, rows, groups), dtype=torch.uint8, device=w.device)
    bad = torch.zeros(1, dtype=torch.int32, device=w.device)
    BR, BG = 32, 4
    grid = (triton.cdiv(rows, BR), triton.cdiv(groups, BG), b)
    k.mxfp4[grid](x, blocks, scales, bad, rows, groups, x.stride(0), x.stride(1), x.stride(2), BR=BR, BG=BG,
                  num_warps=4)
    if bad.item():
        raise ValueError(f"mxfp4: a {tuple(w.shape)} tensor holds inf or nan")
    return blocks.view(*lead, rows, groups, 16), scales.view(*lead, rows, groups)


@functools.cache
def _kernels():
    """The two kernels, built once; only where `available` holds."""
    import triton
    import triton.language as tl

    @triton.jit
    def fp8(x_ptr, q_ptr, s_ptr, rows, cols, sr, sc, bn, bk, BN: tl.constexpr, BK: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1)
        ri = tl.arange(0, BN)
        ci = tl.arange(0, BK)
        r = i * bn + ri
        c = j * bk + ci
        m = ((ri < bn) & (r < rows))[:, None] & ((ci < bk) & (c < cols))[None, :]
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * sr + c[None, :] * sc, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], y.to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + i * tl.cdiv(cols, bk) + j, scale)

    @triton.jit
    def mxfp4(x_ptr, b_ptr, s_ptr, bad_ptr, rows, groups, sb, sr, sc, BR: tl.constexpr, BG: tl.constexpr):
        pb = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        g = tl.program_id(1) * BG + tl.arange(0, BG)
        k = tl.arange(0, 32)
        m2 = (r < rows)[:, None] & (g < groups)[None, :]
        col = g[:, None] * 32 + k[None, :]
        offs = pb * sb + r[:, None, None].to(tl.int64) * sr + col[None, :, :].to(tl.int64) * sc
        x = tl.load(x_ptr + offs, mask=m2[:, :, None], other=0.0).to(tl.float32)
        ax = tl.abs(x)
        nonfinite = ((ax.to(tl.int32, bitcast=True) >> 23) == 255).to(tl.int32)  # inf or nan: exponent bits all set
        tl.atomic_max(bad_ptr, tl.max(tl.max(tl.max(nonfinite, axis=2), axis=1), axis=0))
        amax = tl.max(ax, axis=2)
        bits = amax.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        e = tl.where((bits & 0x7FFFFF) <= 0x400000, biased - 129, biased - 128)
        e = tl.where(biased == 0, -127, tl.minimum(tl.maximum(e, -127), 127))
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e: e <= 126 for finite input, so normal
        a = ax * inv[:, :, None]
        code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))
        code = code | ((x < 0).to(tl.int32) << 3)
        lo, hi = tl.split(tl.reshape(code, (BR, BG, 16, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        row = (pb * rows + r.to(tl.int64))[:, None] * groups + g[None, :]
        tl.store(b_ptr + row[:, :, None] * 16 + tl.arange(0, 16)[None, None, :], packed, mask=m2[:, :, None])
        tl.store(s_ptr + row, (e + 127).to(tl.uint8), mask=m2)

    return type("Kernels", (), {"fp8": fp8, "mxfp4": mxfp4})
