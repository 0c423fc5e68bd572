"""SGLang's scheduler dying under the in-process engine (rollout.sglang.mode=engine): our SIGQUIT handler.

sglang.Engine's processes tell the process that started them that one of them failed by sending it SIGQUIT: a
scheduler or the detokenizer whose loop raised (0.5.14 `managers/scheduler.py:4229-4232`,
`managers/detokenizer_manager.py:498-503`), a scheduler whose watchdog timed out (`utils/watchdog.py:160-163`), and the
engine's own SubprocessWatchdog thread, for a child that died without a word (SIGKILLed, a C++ abort; any nonzero exit:
`utils/watchdog.py:166-221`). SGLang's handler, put in place when the engine starts in the main thread
(`entrypoints/engine.py:1293-1307`), kills the whole process tree, itself included (`kill_process_tree`,
`utils/common.py:1248-1302`: SIGKILL), so the rollout daemon would vanish without a word of why and skip its own
shutdown. Invariants:
- `install(watch)` puts our handler in place of whatever handles SIGQUIT (in the main thread only: Python sets
  handlers there); the process's first install keeps the handler it replaced, and `restore(watch)` puts that one
  back;
- the handler only sets a flag and writes a byte to a pipe: it takes no lock and logs nothing. A thread of this
  module reads the pipe and does the rest (`SchedulerWatch.report`): it waits up to `EXIT_WAIT_S` for one of the
  engine's processes to have exited, names it with its exit status, logs the error (`lost_message`), and calls the
  watch's listeners (the backend stops the engine's event loop, which ends a generate or load waiting on it, and the
  daemon stops with exit code 1);
- once SGLang signalled, every call the backend guards (`guard`) raises `EngineLost`: a new one at once, one in flight
  when it fails;
- a SIGQUIT while the backend shuts its engine down on purpose (`shutting_down`: an mxfp4 restart, close) is counted
  in `ignored` and nothing else: Engine.shutdown stops its SubprocessWatchdog before it SIGKILLs the children
  (0.5.14 `entrypoints/engine.py:898-913`), and a SIGKILLed child signals nothing, so none is expected then;
- every start of the engine runs off the main thread (`owner.EngineOwner`), so SGLang puts in no handler of its own
  (it does only in the main thread); that thread lives as long as the engine, since SGLang's processes die with the
  thread that started them (PR_SET_PDEATHSIG: owner.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

from offpolicy.rollout.engines.errors import EngineLost

log = logging.getLogger("offpolicy.sglang")

EXIT_WAIT_S = 2.0  # after SGLang's SIGQUIT, how long the watch waits for one of the engine's processes to exit


def lost_message(detail: str) -> str:
    return (f"SGLang's scheduler process exited ({detail}): the in-process engine is gone; the rollout daemon exits "
            "so that its supervisor restarts it; see the daemon's log above for SGLang's traceback")


def exit_status(code: int) -> str:
    """A multiprocessing exit code in words."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def title(p: BaseProcess) -> str:
    """What SGLang calls a process of its engine: its process title (`sglang::scheduler_TP0`, `sglang::detokenizer`:
    setproctitle, 0.5.14 `managers/scheduler.py:4148`), else its multiprocessing name."""
    try:
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            name = f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        name = ""
    return name if name.startswith("sglang::") else p.name


class SchedulerWatch:
    """One in-process engine: its processes, whether SGLang signalled that one failed, and who to tell."""

    def __init__(self) -> None:
        self.children: list[BaseProcess] = []  # the engine's processes (multiprocessing children of this process)
        self.titles: dict[int, str] = {}
        self.quiet = False  # the engine is being shut down on purpose
        self.ignored = 0  # SIGQUITs taken while quiet
        self.signalled = False  # SGLang sent SIGQUIT: the engine is lost (set by the handler)
        self.why: str | None = None  # the error, once `report` wrote it
        self.known = threading.Event()
        self.listeners: list[Callable[[str], None]] = []  # called with the error, in the watch's thread

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around the start of sglang.Engine: its processes are the multiprocessing children it added."""
        before = {p.pid for p in multiprocessing.active_children()}
        yield
        self.children = [p for p in multiprocessing.active_children() if p.pid not in before]
        self.titles = {p.pid: title(p) for p in self.children}

    @contextmanager
    def shutting_down(self) -> Iterator[None]:
        """Around Engine.shutdown: a SIGQUIT meanwhile is the shutdown's, not a failure; its processes are gone then."""
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False
            self.children, self.titles = [], {}

    def error(self, wait_s: float = EXIT_WAIT_S + 1.0) -> EngineLost:
        """The EngineLost of this engine (after up to `wait_s` for `report` to have named the process)."""
        self.known.wait(wait_s)
        return EngineLost(self.why or lost_message("one of the engine's processes signalled SIGQUIT"))

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Around a call into the engine: refused with EngineLost once SGLang signalled; one that fails after the
        signal (its event loop stopped by a listener, a start whose scheduler died) raises EngineLost from its error."""
        if self.signalled:
            raise self.error()
        try:
            yield
        except Exception as e:
            if self.signalled and not isinstance(e, EngineLost):
                raise self.error() from e
            raise

    def report(self) -> None:
        """SGLang signalled (in the watch's thread): name the process, log the error, tell the listeners."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while True:
            gone = [(p, p.exitcode) for p in self.children if p.exitcode is not None]
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if gone:
            detail = "; ".join(f"{self.titles.get(p.pid, p.name)} (pid {p.pid}) {exit_status(code)}"
                               for p, code in gone)
        elif self.children:
            detail = (f"one of the engine's processes signalled SIGQUIT; none had exited {EXIT_WAIT_S:.0f} s later: "
                      + ", ".join(f"{self.titles.get(p.pid, p.name)} (pid {p.pid})" for p in self.children))
        else:
            detail = "one of the engine's processes signalled SIGQUIT while the engine was starting"
        self.why = lost_message(detail)
        self.known.set()
        log.error("%s", self.why)
        for listener in list(self.listeners):
            try:
                listener(self.why)
            except Exception:  # one listener's failure must not keep the others from hearing
                log.exception("a listener of the lost SGLang engine failed")


_UNSET = object()
_current: SchedulerWatch | None = None  # the watch the handler serves
_previous: object = _UNSET  # the SIGQUIT handler before our first install (None: one not set from Python)
_wake: int | None = None  # the pipe's write end (the handler's); its thread reads the other end


def _on_sigquit(signum, frame) -> None:
    """Our SIGQUIT handler: a flag and a byte down the pipe, nothing that takes a lock (see the module doc)."""
    watch = _current
    if watch is None:
        return
    if watch.quiet:
        watch.ignored += 1
        return
    watch.signalled = True
    try:
        os.write(_wake, b"q")
    except (OSError, TypeError):  # the pipe is full (a byte already waits) or gone
        pass


def _serve(read_end: int) -> None:
    while True:
        os.read(read_end, 64)
        watch = _current
        if watch is not None and watch.signalled and not watch.known.is_set():
            try:
                watch.report()
            except Exception:  # the thread must outlive a failed report: calls still raise EngineLost (`guard`)
                log.exception("reporting SGLang's SIGQUIT failed")


def install(watch: SchedulerWatch) -> bool:
    """Make our handler take SIGQUIT for `watch`; False (nothing changed) off the main thread."""
    global _current, _previous, _wake
    if threading.current_thread() is not threading.main_thread():
        return False
    if _wake is None:
        read_end, _wake = os.pipe()
        os.set_blocking(_wake, False)
        threading.Thread(target=_serve, args=(read_end,), name="sglang-sigquit", daemon=True).start()
    previous = signal.signal(signal.SIGQUIT, _on_sigquit)
    if _previous is _UNSET and previous is not _on_sigquit:
        _previous = previous
    _current = watch
    return True


def restore(watch: SchedulerWatch) -> None:
    """`watch`'s engine is closed: the handler before our first install takes SIGQUIT again (from the main thread;
    elsewhere ours stays in place and ignores it)."""
    global _current
    if _current is not watch:
        return
    _current = None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGQUIT, signal.SIG_DFL if _previous in (_UNSET, None) else _previous)
