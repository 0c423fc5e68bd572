"""The weight fingerprint's speed (offpolicy/rollout/engines/fingerprint.py), ours against the element-wise
splitmix64 sum it replaced for 1- and 2-byte elements, in one run, on this machine's CPU or GPU:
    python benchmarks/fingerprint_speed.py [--device cuda] [--mib 256]
For each dtype (MXFP4 blocks are uint8, fp8 versions float8_e4m3fn, bf16 versions bfloat16): GB/s of both and the
ratio, with the two fingerprints checked equal. The vLLM engine proves every load by fingerprinting the server's
tensors and the version's files: at GPT-OSS-20B's size (13.8 GB in MXFP4, 41.8 GB in bf16) that hashing is on the
rollouts' critical path (docs/vllm.md)."""

from __future__ import annotations

import argparse
import time

import torch

from offpolicy.rollout.engines import fingerprint as fp


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
    print(f"| dtype | MiB | element-wise GB/s | histogram GB/s | speed-up | equal |\n| --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.bfloat16):
        n = args.mib * (1 << 20) // torch.empty(0, dtype=dtype).element_size()
        t = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g,
                          dtype=torch.uint8).view(dtype).to(args.device)
        a, ta = timed(fp.elementwise_fingerprint, t, args.device)
        b, tb = timed(fp.tensor_fingerprint, t, args.device)
        gb = t.numel() * t.element_size() / 1e9
        print(f"| {str(dtype).removeprefix('torch.')} | {args.mib} | {gb / ta:.3f} | {gb / tb:.3f} | {ta / tb:.1f}x | "
              f"{a == b} |", flush=True)
        assert a == b, f"{dtype}: the histogram fingerprint differs from the element-wise one"


if __name__ == "__main__":
    main()
