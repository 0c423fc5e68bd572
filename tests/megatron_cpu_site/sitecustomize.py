"""Test-only: lets `offpolicy run` start a Megatron learner on a machine without CUDA.

With this directory on PYTHONPATH (`PYTHONPATH=tests/megatron_cpu_site offpolicy run CONFIG`), every
Python process runs this at start-up; the learner daemon (`-m offpolicy.services.learner`, seen in
`sys.orig_argv`) installs tests/megatron_cpu_shim.py before anything else, as the integration tests'
`shimmed()` programs do. Other processes (the launcher, rollouts) are left alone. Never on a GPU host.
"""

import sys
from pathlib import Path

if "offpolicy.services.learner" in getattr(sys, "orig_argv", ()):
    root = str(Path(__file__).resolve().parents[2])  # the repository, for `tests.megatron_cpu_shim`
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.megatron_cpu_shim import install

    install()
