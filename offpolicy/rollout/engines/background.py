"""Work an engine runs beside its generation: `Background(key, compute, device)` calls `compute()` in a thread
(on its own CUDA stream on a GPU, so its kernels run beside the server's), `done(key)` says whether it has ended,
and `result(key)` waits for it and returns its value with when it began, how long it took and its thread's CPU time,
or None when it was started for another key.

A vLLM worker stages each announced version this way (`vllm/worker.Extension.offpolicy_prefetch`, `staging.py`, where
`rollout.vllm.prefetch` says), or only hashes its files, and the in-process SGLang engine stages it on its GPU
(`sglang/staged.py`, `rollout.sglang.prefetch`): the version's read and the files' half of the load's proof
then run while the server still generates with the version before, off the rollout's critical path
(`rollout.double_buffer`, docs/vllm.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offpolicy.plumbing.trace import now


@dataclass
class Done:
    value: Any
    began: float  # when the work started (plumbing.trace.now())
    seconds: float  # how long it ran
    waited: float  # how long `result` waited for it
    cpu_seconds: float = 0.0  # the CPU time its thread took (time.thread_time): near `seconds` where the work held a
    # core (and Python's GIL) throughout, beside the engine's own threads; near 0 where it waited on I/O and the GPU


class Background:
    def __init__(self, key: str, compute: Callable[[], Any], device: torch.device):
        self.key, self.began = key, now()
        self._value: Any = None
        self._error: BaseException | None = None
        self._seconds = self._cpu_seconds = 0.0
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(compute, device), name="offpolicy-background", daemon=True).start()

    def _run(self, compute: Callable[[], Any], device: torch.device) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            with torch.inference_mode():
                if device.type == "cuda":
                    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
                        self._value = compute()
                else:
                    self._value = compute()
        except BaseException as e:  # handed to `result`'s caller
            self._error = e
        finally:
            self._seconds, self._cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
            self._done.set()

    def done(self, key: str) -> bool | None:
        """Whether the work started for `key` has ended (no wait), or None when it was started for another key."""
        return self._done.is_set() if key == self.key else None

    def result(self, key: str) -> Done | None:
        """The work's outcome if it was started for `key` (waiting for it to end; its error raised), else None."""
        if key != self.key:
            return None
        t0 = time.perf_counter()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return Done(self._value, self.began, self._seconds, time.perf_counter() - t0, self._cpu_seconds)
