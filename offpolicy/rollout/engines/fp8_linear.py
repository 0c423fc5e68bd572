"""An fp8 block-wise linear layer for the torch engine (`rollout.fp8_matmul`): the weight stays float8 e4m3 with its
block scales, as the fp8 version stores it, and the matmul runs in fp8.

`Fp8Linear` replaces an `nn.Linear` whose weight an fp8 version quantizes (`weights/fp8.py`). It holds, as
persistent buffers under the checkpoint's own names, `weight` float8_e4m3fn `[out, in]` and `weight_scale_inv`
float32 `[ceil(out / b0), ceil(in / b1)]` (the dequantization multiplier of each block), and `bias` if the linear has
one; so a version's tensors are read into it byte for byte, like a native version's (no dequantize, no cast).

Forward, `y = x W^T + b`:
1. the activations are quantized per token in groups of `GROUP` (128) along the input, as DeepSeek-V3, vLLM and
   SGLang do (`quantize_activations`): per group `s = amax / 448` (1 for an all-zero group), `q = e4m3(x / s)`;
2. `kernel="cuda"`: torch's scaled matmul, `torch.nn.functional.scaled_mm` with the recipe
   `ScalingType.BlockWise1x128` for the activations and `BlockWise128x128` for the weight (cuBLASLt >= 12.9, SM90
   only: torch's `_check_deepseek_support`), which needs weight blocks of [128, 128] and input and output widths that
   are multiples of 128 (`kernel_problems` says why not); the scales go in the layouts torch's checks ask for
   (activations' `[M, K/128]` outer-dim-major; the weight's `[round_up(K/128, 4), N/128]`, K-major, zero-padded);
   `kernel="reference"`: the same math in float32 on any device (`reference_product`): both operands dequantized
   (`q * scale` over each group / block, edge blocks cropped) and multiplied. The CPU tests hold the engine's
   scaled path with it; on a GPU the probe in `fp8_matmul` holds the kernel against it.

Accuracy against the dequantized-weight product (what `rollout.fp8_matmul=dequantize` computes): only the
activations' rounding is added, at most `|x| 2^-4` per element (3 mantissa bits), or `s 2^-10` below e4m3's normal
range; the weights are the version's own bits either way.
"""

from __future__ import annotations

import torch

GROUP = 128  # activation elements per scale along the input (the kernels' 1 x 128)


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`x[M, K]` -> (float8_e4m3fn `[M, K]`, float32 scales `[M, ceil(K / group)]`), the last group partial if
    `group` does not divide K. The scale multiplies: `x ~= q.float() * scale` over each group. The weights'
    quantizer with 1 x `group` blocks (`weights.fp8.quantize`: one Triton kernel on a GPU)."""
    from offpolicy.weights import fp8

    return fp8.quantize(x, (1, group))


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """Block scales `[ceil(rows/bn), ceil(cols/bk)]` repeated over each block, cropped to `[rows, cols]`."""
    return scale.float().repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def reference_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                      block: tuple[int, int], group: int = GROUP) -> torch.Tensor:
    """float32 `(xq * xs) @ (wq * ws)^T` with both operands dequantized over their groups / blocks: the math the
    scaled kernel runs (it accumulates in float32 as well)."""
    m, k = xq.shape
    a = xq.float() * expand_blocks(xs, m, k, 1, group)
    w = wq.float() * expand_blocks(ws, wq.shape[0], k, *block)
    return a @ w.t()


def kernel_problems(shapes: dict[str, tuple[int, int]], block: tuple[int, int]) -> list[str]:
    """Why torch's SM90 block-scaled matmul (1x128 activations, 128x128 weight blocks) cannot run these linears
    (`{module: (out, in)}`) with weight blocks `block`; [] when it can. One line per kind, with the first module."""
    found: dict[str, str] = {}
    if tuple(block) != (GROUP, GROUP):
        found["block"] = (f"weight blocks {list(block)}: torch's scaled_mm on SM90 scales weights in 128 x 128 blocks "
                          "and activations in 1 x 128 groups (cuBLASLt's block scaling) only")
    for module, (n, k) in shapes.items():
        if k % GROUP:
            found.setdefault("in", f"{module}: input {k} is not a multiple of {GROUP} (activation groups)")
        if n % GROUP:
            found.setdefault("out", f"{module}: output {n} is not a multiple of {GROUP} (torch's checks count "
                                    f"{GROUP}-row weight blocks by floor division)")
    return list(found.values())


def cuda_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    groups = ws.shape[1]
    a_scale = xs.new_empty((xs.shape[1], xs.shape[0])).t().copy_(xs)  # [M, K/128], strides (1, M) (M = 1 too)
    # [N/128, L] -> [N/128, round_up(L, 4)] zero-padded -> transposed: [L4, N/128], strides (1, L4)
    b_scale = torch.nn.functional.pad(ws, (0, -groups % 4)).t()
    fused = bias is not None and out_dtype in (torch.bfloat16, torch.float16)  # no fused bias with a float32 output
    y = scaled_mm(xq, wq.t(), a_scale, ScalingType.BlockWise1x128, b_scale, ScalingType.BlockWise128x128,
                  bias=bias.to(out_dtype) if fused else None, output_dtype=out_dtype)
    return y if bias is None or fused else y + bias.to(out_dtype)


class Fp8Linear(torch.nn.Module):
    """`nn.Linear` with a float8 e4m3 weight in blocks of `block` and its scales (see the module doc)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool, kernel: str,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if kernel not in ("cuda", "reference"):
            raise ValueError(f"Fp8Linear kernel is cuda or reference, not {kernel!r}")
        self.in_features, self.out_features = in_features, out_features
        self.block, self.kernel = (int(block[0]), int(block[1])), kernel
        bn, bk = self.block
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale_inv", torch.ones((-(-out_features // bn), -(-in_features // bk)), dtype=torch.float32,
                                               device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def of(cls, linear: torch.nn.Linear, block: tuple[int, int], kernel: str) -> Fp8Linear:
        """An `Fp8Linear` holding `linear`'s weight quantized in `block` (`weights.fp8.quantize`) and its bias."""
        from offpolicy.weights import fp8

        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, block, linear.bias is not None, kernel, w.device, w.dtype)
        q, s = fp8.quantize(w, block)
        with torch.no_grad():
            out.weight.copy_(q)
            out.weight_scale_inv.copy_(s)
            if linear.bias is not None:
                out.bias.copy_(linear.bias.detach())
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={list(self.block)}, kernel={self.kernel}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xq, xs = quantize_activations(x2)
        if self.kernel == "cuda":
            y = cuda_product(xq, xs, self.weight, self.weight_scale_inv, self.bias, x.dtype)
        else:
            y = reference_product(xq, xs, self.weight, self.weight_scale_inv, self.block)
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        return y.reshape(*lead, self.out_features)
