"""The learner process's host heap: given back to the system, and kept out of the cyclic collector's way.

`trim()` gives the C heap's free pages back (glibc's malloc_trim): reads below malloc's mmap threshold (an MXFP4
expert row's blocks, a few MiB each) come from its arenas, which keep their freed pages, so a rank that loaded a
large checkpoint held tens of GiB of free heap; with the optimizer on the host that memory is the host's limit.
A no-op where glibc is not the C library. `settle()` collects once and freezes what survives (`gc.freeze`): the
model, the optimizer, megatron's and the compiled kernels' objects live as long as the learner, and each full
collection scanned them all, and a step that met one ran tens of ms long (docs/benchmarks.md). Steps' garbage is
still collected; `release()` gives the frozen objects back to the collector. GPU learners settle only (the
collection itself takes that long once; CPU learners are tests and the quickstart).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def trim() -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim(0)


def settle() -> None:
    gc.collect()
    gc.freeze()


def release() -> None:
    gc.unfreeze()
