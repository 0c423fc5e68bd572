"""The thread that starts the in-process sglang.Engine and lives as long as it does (`EngineOwner`).

Why a thread that lives on: SGLang's scheduler and detokenizer processes call `kill_itself_when_parent_died()`
(0.5.14 `srt/utils/common.py:2538-2543`: `prctl(PR_SET_PDEATHSIG, SIGKILL)`), and on Linux the "parent" of
PR_SET_PDEATHSIG is the *thread* that forked the child, not its process (prctl(2): "the 'parent' in this case is
considered to be the thread that created this process"). A start in a short-lived thread therefore has the kernel
SIGKILL the scheduler the moment that thread ends, which is the moment `sglang.Engine()` returned, i.e. the engine
was ready (seen on an H200 with 0.5.14: CUDA graph capture done, then `Subprocess scheduler_0 ... crashed with exit
code -9`, and the rollout daemon gone). Invariants:
- every start of the engine runs `call()` in a new thread of this module, whichever thread asks: never the main
  thread, where sglang.Engine would put in its SIGQUIT handler, which kills the whole process tree when a scheduler
  fails (0.5.14 `entrypoints/engine.py:1293-1307`, see sigquit.py), and never a caller's thread, which might end
  before the engine (a worker thread of asyncio.to_thread);
- the thread outlives the engine: after `call()` returned it blocks until `release()`, which the backend calls after
  the engine's `shutdown()` (close, an mxfp4 restart) or when anything after the call failed; when `call()` raised,
  the thread ends at once (what a failed start left alive dies with it: PR_SET_PDEATHSIG);
- the caller waits in short waits, so that a KeyboardInterrupt still reaches the main thread; a caller interrupted
  so releases the owner: the engine that start may still return would have nobody to shut it down, and its processes
  die when the thread ends;
- the thread is a daemon thread: a non-daemon one that was never released would keep the interpreter from exiting
  (threading joins non-daemon threads before the atexit handlers run, SGLang's `Engine.shutdown` among them). At
  exit the whole process goes, and SGLang's children with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")

WAIT_S = 0.5  # the caller's wait for the start, one slice at a time (KeyboardInterrupt gets through between them)
RELEASE_JOIN_S = 5.0  # how long release waits for the thread to have ended


class EngineOwner:
    """One start of an engine: `start(call, name)` once, `release()` once the engine is shut down."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self._done = threading.Event()  # call() returned or raised
        self._released = threading.Event()
        self._result: object = None
        self._error: BaseException | None = None

    def start(self, call: Callable[[], T], name: str) -> T:
        """`call()` in the thread `name`, which stays alive after it returned, until `release()`; its result, or its
        exception raised here (the thread has ended then)."""
        if self.thread is not None:
            raise RuntimeError(f"this EngineOwner already started {self.thread.name!r}")
        self.thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self.thread.start()
        try:
            while not self._done.wait(WAIT_S):
                pass
        except BaseException:  # a KeyboardInterrupt: nobody will shut down what the call may still start
            self.release(wait_s=0.0)
            raise
        if self._error is not None:
            self.thread.join()
            raise self._error
        return cast(T, self._result)

    def _run(self, call: Callable[[], object]) -> None:
        try:
            self._result = call()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            self._error = e
            self._done.set()
            return  # what the start left alive dies with this thread (PR_SET_PDEATHSIG)
        self._done.set()
        self._released.wait()  # the engine's processes live while this thread does (the module doc)

    @property
    def holding(self) -> bool:
        """The thread is alive: it is starting the engine, or holds one that was not released."""
        return self.thread is not None and self.thread.is_alive()

    def release(self, wait_s: float = RELEASE_JOIN_S) -> None:
        """The engine is shut down: the thread ends (within `wait_s`), and with it, by PR_SET_PDEATHSIG, any process
        of the engine still alive. Idempotent; harmless before a start."""
        self._released.set()
        if self.thread is not None and self.thread is not threading.current_thread() and wait_s > 0:
            self.thread.join(wait_s)
