"""The weight fingerprint's speed (offpolicy/rollout/engines/fingerprint.py) by each of its ways, in one run, on this
machine's CPU or GPU:
    python benchmarks/fingerprint_speed.py [--device cuda] [--mib 256]
For each dtype (MXFP4 blocks are uint8, fp8 versions float8_e4m3fn, bf16 versions bfloat16): GB/s of the element-wise
splitmix64 sum (the definition), the histogram of bit patterns (the torch path for 1- and 2-byte elements) and, on a
GPU, the one Triton kernel (`fingerprint_triton.py`, what `tensor_fingerprint` runs there), with its ratio over the
histogram, all three checked equal. The vLLM and SGLang engines prove every load by fingerprinting the engine's tensors
and the version's files: at GPT-OSS-20B's size (13.8 GB in MXFP4, 41.8 GB in bf16) that hashing is on the rollouts'
critical path (docs/vllm.md).

Then MXFP4 experts held in triton_kernels' Hopper value layout (vLLM's and SGLang's on Hopper; triton_kernels' own
layout where it imports, else the tests' layout written from its format), GPT-OSS-20B's gate_up shape (32 experts x
5,760 x 1,440 bytes, 265 MB a layer): seconds of `unswizzle_data` a few experts at a time and then the hash (the way
before the twenty-sixth session) against hashing the held words' unpacked bytes in one pass (`hopper_value_hash.py`:
one Triton kernel on a GPU; on a CPU its torch reference, slower than the unswizzle, which the proofs then use), the
ratio, both checked equal to the checkpoint's hash, and what each would take for GPT-OSS-20B's 9.55 GB of expert
values."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/kernel_wrappers.py, the Hopper layout's stand-in

import torch  # noqa: E402

from offpolicy.rollout.engines import fingerprint as fp  # noqa: E402
from offpolicy.rollout.engines import fingerprint_triton as ft  # noqa: E402


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

    hopper(args.device, g)


GPT_OSS_20B_EXPERT_BYTES = 24 * 32 * (5760 * 1440 + 2880 * 1440)  # gate_up and down values, every layer


def hopper_layout():
    """triton_kernels' HopperMXValueLayout (the package, or vLLM's vendored copy) and where it came from; the tests'
    stand-in where neither imports."""
    for name in ("triton_kernels", "vllm.third_party.triton_kernels"):
        try:
            module = __import__(f"{name}.tensor_details.layout_details.hopper_value", fromlist=["HopperMXValueLayout"])
            return module.HopperMXValueLayout, name
        except Exception:  # noqa: BLE001 - not installed here, or it needs a GPU: the next one
            continue
    from tests.kernel_wrappers import HopperValueLayout

    return (lambda shape, mx_axis: HopperValueLayout(shape, transposed=True)), "tests/kernel_wrappers.py (stand-in)"


def hopper(device: str, g: torch.Generator, shape=(32, 5760, 1440)) -> None:
    from types import SimpleNamespace

    from offpolicy.rollout.engines import hopper_value_hash as hv

    make, where = hopper_layout()
    blocks = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)
    layout = make(shape, mx_axis=1)
    held = SimpleNamespace(layout=layout, data=layout.swizzle_data(blocks))
    before = SimpleNamespace(layout=SimpleNamespace(unswizzle_data=layout.unswizzle_data))  # no name: the unswizzle
    assert hv.held_words(held, held.data) is not None and hv.held_words(before, held.data) is None
    want = fp.tensor_fingerprint(blocks)
    a, ta = timed(lambda t: fp.held_fingerprint(before, t), held.data, device)
    words = hv.held_words(held, held.data)
    kernel = hv.fingerprint(words[:1024], fp.tensor_fingerprint) is not None  # here, self-checked
    way = "held words, one Triton kernel" if kernel else "held words, torch (the kernel's reference: no kernel here)"
    hashed = (lambda w: hv.fingerprint(w, fp.tensor_fingerprint)) if kernel else (
        lambda w: hv.torch_fingerprint(w, fp.tensor_fingerprint))
    b, tb = timed(lambda t: hashed(hv.held_words(held, t)), held.data, device)
    scale = GPT_OSS_20B_EXPERT_BYTES / blocks.numel()
    print(f"\nMXFP4 values in the Hopper value layout ({where}), {blocks.numel() / 1e6:.0f} MB on {device}:\n\n"
          "| way | s | GB/s | GPT-OSS-20B's experts s | equal to the checkpoint's |\n| --- | --- | --- | --- | --- |")
    for way, value, sec in (("unswizzle, then hash", a, ta), (way, b, tb)):
        print(f"| {way} | {sec:.4f} | {blocks.numel() / 1e9 / sec:.2f} | {sec * scale:.3f} | {value == want} |")
    print(f"\nthe held words' speed-up over the unswizzle: **{ta / tb:.1f}x**")
    assert a == b == want, f"the Hopper value fingerprints differ ({a}, {b}, {want})"


if __name__ == "__main__":
    main()
