"""Run a check program in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported): the CPU
tests of the Triton kernels (offpolicy/weights/triton_quant.py, offpolicy/learner/backends/megatron/kernels/moe_triton.py,
grad_accum.py). The program prints "ok" last when every check held."""

import os
import subprocess
import sys


def assert_interpreted_ok(program: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
