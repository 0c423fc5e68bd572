"""Running generated code for rewards: a subprocess with time, memory and no-network limits.

`run_python(code, timeout_s, memory_mb)` runs `python -I -c code` in a fresh temporary directory
with an empty environment, RLIMIT_AS (memory), RLIMIT_CPU and a wall-clock timeout, RLIMIT_FSIZE and
RLIMIT_NOFILE, and in a new network namespace (no interface but a downed loopback), entered with
unshare(2) before exec. If the network cannot be isolated (not root and no unprivileged user
namespaces) it refuses to run the code rather than run it with the network (`SandboxError`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


class SandboxError(RuntimeError):
    """The sandbox could not be set up; the code was not run."""


@dataclass
class Result:
    returncode: int  # -9 when killed (time or memory), the exit status otherwise
    stdout: str
    stderr: str
    timed_out: bool


def _isolate(memory_mb: int, cpu_s: int) -> None:
    """In the child, before exec: drop the network, then cap memory, CPU, files."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        os.write(2, b"offpolicy sandbox: cannot isolate the network\n")
        os._exit(97)
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, stdin: str = "") -> Result:
    with tempfile.TemporaryDirectory(prefix="offpolicy-sandbox-") as cwd:
        try:
            p = subprocess.run([sys.executable, "-I", "-S", "-c", code], input=stdin, capture_output=True,
                               text=True, cwd=cwd, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                               timeout=timeout_s, preexec_fn=lambda: _isolate(memory_mb, max(1, int(timeout_s) + 1)))
        except subprocess.TimeoutExpired as e:
            return Result(-9, _text(e.stdout), _text(e.stderr), timed_out=True)
    if p.returncode == 97 and "cannot isolate the network" in p.stderr:
        raise SandboxError("cannot isolate generated code from the network: run the rollout as root or enable "
                           "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)")
    return Result(p.returncode, p.stdout, p.stderr, timed_out=False)


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
