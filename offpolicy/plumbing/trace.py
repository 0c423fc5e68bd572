"""The run's timeline (`run.trace`): every process writes what it spends its time on, one span a line.

`Tracer(cfg, process)` appends spans to `<run.dir>/<run.name>/trace/<process>.jsonl`: `{"name", "ts", "dur",
"thread", "args"}` with `ts` the wall start and `dur` the length, in microseconds. `span(name, **args)` is a
context manager; `add(name, start, seconds, lane=None, **args)` records a span measured elsewhere, on the writing
thread's track or on its own `lane` (work that ran beside the writer: Perfetto draws a track's spans only where
they nest). The learner writes `wait batch`, `train`, `publish stall` per step, `publish` (each version from its
snapshot to its commit, just before its announcement; lane `publish`; a sharded publish's parts inside it as
`publish: <part>`, weights/sharded.py) and `receive` (a receive batch of the hub that brought groups: their
intake, with their leases; lane `hub`); a rollout daemon `wait lease`, `load` (a weight swap, with the version),
`prefetch` (with `rollout.double_buffer`: the background read of a version it swapped in, written at the swap;
lane `prefetch`), `generate` (with the lease's groups and version) and `score and send` (the lease's rewards and
its groups sent to the hub). Lines are buffered and written at least once a second and at exit; a process
killed mid-run loses at most that second. With `run.trace` false (the default) every call is a no-op.
Spans' times come from `now()`: the wall clock read once per process, advanced by perf_counter. Within a process
it never steps (an NTP or hypervisor step of the wall clock during a span would make the next span begin before it
ended, and Perfetto would draw it on a second track); across processes it is the wall clock as of each one's start.
Times read in another process (a server's report, another rank's) are wall clock readings.
`offpolicy trace RUN_DIR` (offpolicy/loggers/timeline.py) merges the files into `trace.json` (Chrome's trace
event format: Perfetto and chrome://tracing open it) and draws `timeline.png`. On a cluster each node writes
into its own copy of the run directory's path; gather the `trace/` folders to merge them. Imports nothing heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time
from pathlib import Path

from offpolicy.config import Config

FLUSH_S = 1.0
_WALL0, _PERF0 = time.time(), time.perf_counter()


def now() -> float:
    """Seconds since the epoch for the timeline: the wall clock when this process imported the module, advanced by
    perf_counter since (so a span's start plus its perf_counter length is where the next one can start)."""
    return _WALL0 + (time.perf_counter() - _PERF0)


def trace_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) / cfg.run.name / "trace"


class Tracer:
    def __init__(self, cfg: Config, process: str):
        self.on = cfg.run.trace
        self.file = trace_dir(cfg) / f"{process}.jsonl"
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._last = time.monotonic()
        if self.on:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            atexit.register(self.flush)

    @contextlib.contextmanager
    def span(self, name: str, **args):
        if not self.on:
            yield
            return
        start = now()
        try:
            yield
        finally:
            self.add(name, start, now() - start, **args)

    def add(self, name: str, start: float, seconds: float, lane: str | None = None, **args) -> None:
        """A span of `seconds` that began at `start` (`now()`'s reading, or another process's wall clock), on the
        calling thread's track or on `lane`'s (work that ran beside the caller, a background publish or read: one
        track's spans must nest)."""
        if not self.on:
            return
        ts = round(start * 1e6)  # the end rounded too: a span that starts where another ends starts at its end
        line = json.dumps({"name": name, "ts": ts, "dur": max(1, round((start + seconds) * 1e6) - ts),
                           "thread": lane or threading.current_thread().name, "args": args})
        with self._lock:
            self._lines.append(line)
            due = time.monotonic() - self._last >= FLUSH_S
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            self._last = time.monotonic()
        if lines:
            with open(self.file, "a") as f:
                f.write("\n".join(lines) + "\n")
