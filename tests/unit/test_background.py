"""offpolicy.rollout.engines.background.py: work a vLLM worker runs in a thread beside its generation."""

import threading
import time

import pytest
import torch

from offpolicy.rollout.engines.background import Background

CPU = torch.device("cpu")


def test_the_result_is_the_computed_value_for_its_key_only():
    release = threading.Event()

    def compute():
        release.wait(10)
        return torch.arange(5).sum().item()

    work = Background("/v/1", compute, CPU)
    assert work.result("/v/2") is None  # another version's files: not this work's, and no wait for it
    release.set()
    done = work.result("/v/1")
    assert done.value == 10 and done.seconds > 0 and done.began > 0 and done.waited >= 0


def test_the_work_runs_beside_the_caller():
    started, release = threading.Event(), threading.Event()

    def compute():
        started.set()
        assert release.wait(10)
        return "hashed"

    work = Background("k", compute, CPU)
    assert started.wait(10)  # it runs while this thread goes on (and would block if it ran here)
    release.set()
    assert work.result("k").value == "hashed"


def test_an_error_of_the_work_is_raised_to_whoever_takes_the_result():
    def compute():
        raise FileNotFoundError("the version was removed")

    work = Background("k", compute, CPU)
    with pytest.raises(FileNotFoundError, match="removed"):
        work.result("k")


def test_its_cpu_time_tells_work_that_held_a_core_from_work_that_waited():
    """`cpu_seconds`: the thread's own CPU time (time.thread_time), so a staging that waits on I/O shows near 0 and
    one that computes in Python (holding the GIL beside the engine's threads) near its wall time, whatever else the
    machine runs (2 busy cores in CI)."""
    waited = Background("k", lambda: threading.Event().wait(0.3), CPU).result("k")
    assert waited.seconds >= 0.3 and waited.cpu_seconds < 0.1

    def spin():
        t = time.thread_time()
        while time.thread_time() - t < 0.2:  # 0.2 s of this thread's own CPU, however long that takes
            pass

    busy = Background("k", spin, CPU).result("k")
    assert 0.2 <= busy.cpu_seconds <= busy.seconds + 0.05
