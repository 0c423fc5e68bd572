"""Where offpolicy's own Triton kernels run: one gate for the learner's (learner/backends/megatron/kernels/moe_triton.py and the
modules that take its `available`: norms.py, grad_accum.py) and the quantizers' (weights/triton_quant.py).

`runs(device_type, switch)`: not where the environment sets `switch` to 1 (each family's off switch:
OFFPOLICY_EAGER_KERNELS, OFFPOLICY_EAGER_QUANT; their callers then run their eager or compiled paths); on
CUDA, or on any device under TRITON_INTERPRET=1 (Triton's interpreter on a CPU, for the tests); and only where
`triton` imports (checked once). No torch import: the callers pass a tensor's device type.
"""

from __future__ import annotations

import functools
import os


def runs(device_type: str, switch: str) -> bool:
    """Whether Triton kernels run for a tensor on `device_type` (module docstring)."""
    if os.environ.get(switch) == "1":
        return False
    return (device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and triton_imports()


@functools.cache
def triton_imports() -> bool:
    """Whether `import triton` succeeds in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
