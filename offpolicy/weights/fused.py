"""`on_gpu(f)`: run a pure tensor function through torch.compile when its input lives on a GPU.

MXFP4's dequantize (`mxfp4._dequantize`, what the torch engine runs on each swap to an mxfp4 version)
is a chain of elementwise steps (two table lookups, a stack, ldexp, a cast), each a pass over the whole
weight when run eagerly; compiled (inductor, dynamic shapes, once per process at the first GPU call:
a few seconds, on the first swap) it is one fused kernel, 2.4x faster on an H100 (docs/weights.md).
Only exact operations (lookups, multiplication by powers of two, a cast), so the compiled function
gives the eager one's bits (tests/gpu/test_weight_formats_gpu.py). On a CPU, or with
`OFFPOLICY_EAGER_QUANT=1`, the function runs as written. (Quantizing has Triton kernels of its own,
`triton_quant.py`: compiled torch was 5-8x slower than them for MXFP4 and no faster than eager for fp8.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable


def on_gpu(f: Callable) -> Callable:
    """`f(x, *args)`, compiled for CUDA tensors `x` (dynamic shapes), eager otherwise."""
    compiled = None

    @functools.wraps(f)
    def run(x, *args):
        nonlocal compiled
        if x.device.type != "cuda" or os.environ.get("OFFPOLICY_EAGER_QUANT") == "1":
            return f(x, *args)
        if compiled is None:
            import torch

            compiled = torch.compile(f, dynamic=True)
        return compiled(x, *args)

    run.eager = f
    return run

