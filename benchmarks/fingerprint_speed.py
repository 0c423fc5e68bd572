"""The weight fingerprint's speed (offpolicy/rollout/engines/fingerprint.py) by each of its ways, in one run, on this
machine's CPU or GPU:
    python benchmarks/fingerprint_speed.py [--device cuda] [--mib 256]
For each dtype (MXFP4 blocks are uint8, fp8 versions float8_e4m3fn, bf16 versions bfloat16): GB/s of the element-wise
splitmix64 sum (the definition), the histogram of bit patterns (the torch path for 1- and 2-byte elements) and, on a
GPU, the one Triton kernel (`fingerprint_triton.py`, what `tensor_fingerprint` runs there), with its ratio over the
histogram, all three checked equal. The vLLM and SGLang engines prove every load by fingerprinting the engine's tensors
and the version's files: at GPT-OSS-20B's size (13.8 GB in MXFP4, 41.8 GB in bf16) that hashing is on the rollouts'
critical path (docs/vllm.md)."""

from __future__ import annotations

import argparse
import time

import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines import fingerprint_triton as ft


def timed(f, t: torch.Tensor, device: str) -> tuple[int, float]:
    f(t[: 1 << 20])  # warm-up (kernels, the pattern table)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    value = f(t)
    if device == "cuda":
        torch.cuda.synchronize()
    return value, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mib", type=int, default=256, help="tensor size per dtype (MiB)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print("| dtype | MiB | element-wise GB/s | histogram GB/s | Triton GB/s | Triton vs histogram | equal |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.bfloat16):
        n = args.mib * (1 << 20) // torch.empty(0, dtype=dtype).element_size()
        t = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                          dtype=torch.uint8).view(dtype).to(args.device)
        gb = t.numel() * t.element_size() / 1e9
        a, ta = timed(fp.elementwise_fingerprint, t, args.device)
        b, tb = timed(lambda x: fp._histogram_fingerprint(x, 1 << 24), t, args.device)
        triton = lambda x: ft.fingerprint(x, lambda sample: fp._torch_fingerprint(sample, 1 << 24))  # noqa: E731
        c, tc = timed(triton, t, args.device) if ft.available(t) else (None, float("nan"))
        print(f"| {str(dtype).removeprefix('torch.')} | {args.mib} | {gb / ta:.3f} | {gb / tb:.3f} | "
              f"{gb / tc if c is not None else float('nan'):.3f} | {tb / tc if c is not None else float('nan'):.1f}x | "
              f"{a == b and c in (None, a)} |", flush=True)
        assert a == b and c in (None, a), f"{dtype}: the fingerprints differ ({a}, {b}, {c})"

if __name__ == "__main__":
    main()
