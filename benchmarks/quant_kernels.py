"""The low-bit quantize/dequantize kernels alone on one GPU (docs/weights.md, issues 15 and 53): eager torch vs
torch.compile vs the Triton kernels (offpolicy/weights/triton_quant.py) on a GPT-OSS-20B expert tensor
(`[32, 2880, 5760]` bf16, quantized as its transpose, as the publish path does) and an attention-sized
`[5760, 2880]` weight for fp8, medians of 5 after a warm-up, beside a pinned device-to-host copy of the
expert tensor as the yardstick; it also checks that the fp8 kernel gives the eager definition's bits.

    python benchmarks/quant_kernels.py          (a CUDA GPU; prints a markdown table)
"""

import sys
import time

import torch

from offpolicy.weights import fp8, mxfp4
from offpolicy.weights import triton_quant as tq


def timed(f, *args, n: int = 5) -> float:
    """Median seconds of `n` calls after one warm-up (compilation included there)."""
    f(*args)
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f(*args)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[n // 2]


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quant_kernels.py needs a CUDA GPU")
    experts = torch.randn(32, 2880, 5760, device="cuda", dtype=torch.bfloat16) * 0.02
    attn = torch.randn(5760, 2880, device="cuda", dtype=torch.bfloat16) * 0.02
    x, eb, ab = experts.transpose(1, 2), experts.numel() * 2, attn.numel() * 2
    rows = []

    def row(name: str, seconds: float, nbytes: int) -> None:
        rows.append(f"| {name} | {seconds * 1e3:.2f} | {nbytes / seconds / 1e9:.0f} |")

    row("mxfp4 quantize, eager torch", timed(mxfp4._quantize, x), eb)
    row("mxfp4 quantize, torch.compile", timed(torch.compile(mxfp4._quantize, dynamic=True), x), eb)
    row("mxfp4 quantize, Triton kernel", timed(tq.mxfp4_quantize, x), eb)
    row("mxfp4 quantize() (the kernel + its finiteness flag)", timed(mxfp4.quantize, x), eb)
    blocks, scales = mxfp4.quantize(x)
    row("mxfp4 dequantize (byte-pair table, chunked)", timed(mxfp4.dequantize, blocks, scales, torch.bfloat16), eb)
    param = torch.empty_like(experts)  # GptOssExperts' [E, in, out]: the torch engine's load writes its transpose
    row("mxfp4 dequantize_into the parameter (transposed view)",
        timed(mxfp4.dequantize_into, blocks, scales, param.transpose(1, 2)), eb)
    exact = True
    for block in ((128, 128), (90, 90)):
        row(f"fp8 {block} quantize, eager torch", timed(fp8._quantize, attn, *block), ab)
        row(f"fp8 {block} quantize, Triton kernel", timed(tq.fp8_quantize, attn, *block), ab)
        q, s = fp8.quantize(attn, block)
        qe, se = fp8._quantize(attn, *block)
        exact &= torch.equal(q.view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s, se)
        row(f"fp8 {block} dequantize, eager torch", timed(fp8._dequantize, q, s, *block, torch.bfloat16), ab)
    host = torch.empty(experts.numel(), dtype=torch.bfloat16, pin_memory=True)
    row("pinned D2H copy of the expert tensor", timed(lambda: host.copy_(experts.view(-1))), eb)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; fp8 kernel == eager: {exact}\n")
    print("| step | ms | GB/s of bf16 input |\n| --- | --- | --- |\n" + "\n".join(rows))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
