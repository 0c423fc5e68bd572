"""Where a publish or a load spends its time: seconds per stage and counts, for `offpolicy bench weights`.

    with profile() as p:
        store.publish(...)
    p.seconds  # {"publish.write": ..., "write.pwrite": ..., ...}

Keys starting with `publish.` or `load.` are wall-clock phases that run one after another (they add up
to about the whole call); the others are busy seconds summed over the copy threads, which overlap
(two threads hashing for 1 s each count 2 s), so they say which work dominates, not how long the call
took. Counts say which path ran (`files.direct`, `files.staged`, `maps.registered`, ...). Off (one
global read per stage) unless a `profile()` block is open; light (no torch) so the store can use it.
`profile(trace=True)` also keeps every stage's interval, `events` (key, thread, start ns, end ns; perf_counter_ns):
what benchmarks/publish_gil.py lines up with the stalls of a launch loop.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class Profile:
    def __init__(self, trace: bool = False):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.events: list[tuple[str, str, int, int]] | None = [] if trace else None
        self._lock = threading.Lock()

    def add(self, key: str, seconds: float, start_ns: int = 0) -> None:
        with self._lock:
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            if self.events is not None and start_ns:
                self.events.append((key, threading.current_thread().name, start_ns, start_ns + int(seconds * 1e9)))

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n


_current: Profile | None = None


@contextmanager
def profile(trace: bool = False):
    """Collect the stages of every publish and load in this process until the block ends (`trace`: with
    each stage's interval, `Profile.events`)."""
    global _current
    prev, _current = _current, Profile(trace)
    try:
        yield _current
    finally:
        _current = prev


@contextmanager
def stage(key: str):
    """Add the block's seconds to `key` of the open profile (if any)."""
    p = _current
    if p is None:
        yield
        return
    t0 = time.perf_counter_ns()
    try:
        yield
    finally:
        p.add(key, (time.perf_counter_ns() - t0) / 1e9, t0)


def count(key: str, n: int = 1) -> None:
    p = _current
    if p is not None:
        p.count(key, n)
