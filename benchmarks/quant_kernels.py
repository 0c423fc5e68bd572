"""The low-bit quantize/dequantize kernels alone on one GPU (docs/weights.md, issue 15): eager torch vs
torch.compile vs the Triton kernels (offpolicy/weights/triton_quant.py) on a GPT-OSS-20B expert tensor
(`[32, 2880, 5760]` bf16, quantized as its transpose, as the publish path does) and an attention-sized
`[5760, 2880]` weight for fp8, medians of 5 after a warm-up, beside a pinned device-to-host copy of the
expert tensor as the yardstick; it also checks that the fp8 kernel gives the eager definition's bits.

    python benchmarks/quant_kernels.py          (a CUDA GPU; prints a markdown table)
"""

import time

import torch

from offpolicy.weights import fp8, mxfp4, triton_quant as tq
def t(f, *a, n=5):
    f(*a); torch.cuda.synchronize()
    ts=[]
    for _ in range(n):
        torch.cuda.synchronize(); t0=time.perf_counter(); f(*a); torch.cuda.synchronize(); ts.append(time.perf_counter()-t0)
    return sorted(ts)[n//2]
g = torch.randn(32, 2880, 5760, device="cuda", dtype=torch.bfloat16) * 0.02
a = torch.randn(5760, 2880, device="cuda", dtype=torch.bfloat16) * 0.02
print("experts gate_up GB", g.numel()*2/1e9, "attention-like GB", a.numel()*2/1e9)
rows = []
def row(name, s, nbytes): rows.append(f"| {name} | {s*1e3:.2f} | {nbytes/s/1e9:.0f} |")
x = g.transpose(1, 2)
row("mxfp4 quantize, eager torch", t(mxfp4._quantize, x), g.numel()*2)
row("mxfp4 quantize, torch.compile", t(torch.compile(mxfp4._quantize, dynamic=True), x), g.numel()*2)
row("mxfp4 quantize, Triton kernel", t(tq.mxfp4_quantize, x), g.numel()*2)
row("mxfp4 quantize() (finite check + kernel)", t(mxfp4.quantize, x), g.numel()*2)
b, s = mxfp4.quantize(x)
row("mxfp4 dequantize, eager torch", t(mxfp4._dequantize.eager, b, s, torch.bfloat16), g.numel()*2)
row("mxfp4 dequantize, torch.compile", t(mxfp4._dequantize, b, s, torch.bfloat16), g.numel()*2)
for blk in [(128,128),(90,90)]:
    row(f"fp8 {blk} quantize, eager torch", t(fp8._quantize, a, *blk), a.numel()*2)
    row(f"fp8 {blk} quantize, Triton kernel", t(tq.fp8_quantize, a, *blk), a.numel()*2)
    q, sc = fp8.quantize(a, blk); qe, se = fp8._quantize(a, *blk)
    print("exact", blk, torch.equal(q.view(torch.uint8), qe.view(torch.uint8)), torch.equal(sc, se))
    row(f"fp8 {blk} dequantize, eager torch", t(fp8._dequantize, q, sc, *blk, torch.bfloat16), a.numel()*2)
h = torch.empty(g.numel(), dtype=torch.bfloat16, pin_memory=True)
row("pinned D2H copy of the bf16 experts", t(lambda: h.copy_(g.view(-1))), g.numel()*2)
print("| step | ms | GB/s of bf16 input |\n| --- | --- | --- |"); print("\n".join(rows))
