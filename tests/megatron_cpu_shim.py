"""The tests' name for offpolicy/learner/backends/megatron/cpu.py (megatron-core on the CPU), which the product
now installs itself when learner.device is cpu."""

from offpolicy.learner.backends.megatron.cpu import install, install_if_cpu, shimmed

__all__ = ["install", "install_if_cpu", "shimmed"]
