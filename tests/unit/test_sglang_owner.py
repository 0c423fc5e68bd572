"""The thread that starts the in-process SGLang engine and lives as long as it
(offpolicy/rollout/engines/sglang/owner.py), with real processes that ask the kernel for PR_SET_PDEATHSIG as SGLang's
scheduler does: they live while the owner holds them and are SIGKILLed once it is released; a start that raised ends
its thread at once."""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys
import threading
import time

import pytest

from offpolicy.rollout.engines.sglang.owner import EngineOwner
from tests.integration.helpers import wait_for

linux = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
PR_SET_PDEATHSIG = 1


def scheduler_like(ready) -> None:
    """A child as SGLang's scheduler: PR_SET_PDEATHSIG (SIGKILL) first, then ready, then it runs until killed."""
    ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    ready.set()
    time.sleep(600)


def engine_like(method: str):
    """A `call` as sglang.Engine(): start the child from the calling thread and return once it is ready (so it asked
    for PR_SET_PDEATHSIG before the start returns)."""
    ctx = multiprocessing.get_context(method)

    def call():
        ready = ctx.Event()
        child = ctx.Process(target=scheduler_like, args=(ready,), name="scheduler-like", daemon=True)
        child.start()
        if not ready.wait(60):
            child.kill()
            raise RuntimeError("the child did not get ready within 60 s")
        return child

    return call


@linux
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_child_started_through_the_owner_lives_until_the_owner_is_released(method):
    """The bug this prevents: a start in a thread that ended once sglang.Engine() returned had the kernel SIGKILL its
    scheduler right then (exit code -9 on an H200 with SGLang 0.5.14)."""
    owner = EngineOwner()
    child = owner.start(engine_like(method), "sglang-start")
    try:
        assert owner.thread is not None and owner.thread.name == "sglang-start"
        assert owner.thread is not threading.current_thread()
        time.sleep(1.0)
        assert child.exitcode is None and owner.holding  # the thread that started it is still alive
        owner.release()
        assert not owner.holding
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        owner.release()
        if child.exitcode is None:
            child.kill()
            child.join(10)


def test_an_exception_of_the_call_is_raised_in_the_caller_and_its_thread_ends():
    owner = EngineOwner()
    seen: list[threading.Thread] = []

    def fail():
        seen.append(threading.current_thread())
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        owner.start(fail, "sglang-start")
    assert seen and seen[0] is owner.thread and seen[0] is not threading.main_thread()
    assert not owner.holding  # ended at once: no release needed
    owner.release()  # harmless


def test_the_call_runs_in_a_thread_of_its_own_from_any_thread_and_release_is_idempotent():
    """From a worker thread too (the daemon loads in asyncio.to_thread): a caller's thread may end before the engine."""
    out: dict = {}
    owner = EngineOwner()

    def caller():
        out["caller"] = threading.current_thread()
        out["result"] = owner.start(threading.current_thread, "sglang-start")

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    t.join(30)
    assert out["result"] is owner.thread and out["result"] is not out["caller"]
    assert owner.holding
    owner.release()
    owner.release()
    assert not owner.holding
    with pytest.raises(RuntimeError, match="already started"):
        owner.start(lambda: 1, "again")


def test_a_release_before_the_call_returned_ends_the_thread_once_it_returns():
    """A caller interrupted while it waits (KeyboardInterrupt) releases the owner: nobody would shut the engine down."""
    owner, go = EngineOwner(), threading.Event()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=owner.start(lambda: go.wait(30) and 5, "sglang-start")),
                         daemon=True)
    t.start()
    wait_for(lambda: owner.holding, 10, "the owner's thread to start")
    owner.release(wait_s=0.0)
    go.set()
    t.join(30)
    assert out["result"] == 5
    wait_for(lambda: not owner.holding, 10, "the owner's thread to end")
