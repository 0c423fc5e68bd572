"""The discrete-event clock and processor-sharing resources the pipeline simulation runs on.

`Clock` runs callbacks in time order (ties in scheduling order). A `Shared` resource is a fluid
processor-sharing server of `capacity` units (GPUs of one group, or the cores of a CPU node): every
running job has `work` seconds to do at full speed and gets speed min(1, capacity / (jobs running +
background)), so two jobs on one GPU each take twice as long and five single-threaded processes on
two cores each run at 0.4; `background` counts other runnable tasks always present (a shared
machine). When a job starts or ends the others' remaining work is brought up to date and the next
completion is scheduled again (stale completions are recognised by a generation counter).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(t, self.now), self._seq, fn))
        self._seq += 1

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    def run(self, until: Callable[[], bool], limit: float = float("inf")) -> None:
        """Run events until `until()` holds, the queue is empty or the clock passes `limit`."""
        while self._queue and not until():
            t, _, fn = heapq.heappop(self._queue)
            if t > limit:
                break
            self.now = t
            fn()


class Shared:
    """Fluid processor sharing of `capacity` units among the jobs running on it."""

    def __init__(self, clock: Clock, capacity: float, name: str = "", background: float = 0.0) -> None:
        if capacity <= 0 or background < 0:
            raise ValueError(f"resource {name!r}: capacity {capacity} must be > 0 and background {background} >= 0")
        self.clock, self.capacity, self.name, self.background = clock, capacity, name, background
        self.jobs: dict[int, list] = {}  # id -> [remaining work, done callback]
        self._ids = 0
        self._last = 0.0
        self._generation = 0
        self.busy_seconds = 0.0  # wall seconds with at least one job running

    def speed(self) -> float:
        return min(1.0, self.capacity / (len(self.jobs) + self.background)) if self.jobs else 0.0

    def start(self, work: float, done: Callable[[], None]) -> None:
        self._advance()
        self.jobs[self._ids] = [max(0.0, work), done]
        self._ids += 1
        self._schedule()

    def _advance(self) -> None:
        now = self.clock.now
        dt = now - self._last
        if self.jobs and dt > 0:
            s = self.speed()
            for job in self.jobs.values():
                job[0] -= s * dt
            self.busy_seconds += dt
        self._last = now

    def _schedule(self) -> None:
        self._generation += 1
        if not self.jobs:
            return
        gen = self._generation
        first = min(job[0] for job in self.jobs.values())
        self.clock.after(max(0.0, first) / self.speed(), lambda: self._complete(gen))

    def _complete(self, generation: int) -> None:
        if generation != self._generation:
            return  # the job set changed since this completion was scheduled
        self._advance()
        finished = [k for k, job in self.jobs.items() if job[0] <= 1e-9]
        callbacks = [self.jobs.pop(k)[1] for k in finished]
        self._schedule()
        for cb in callbacks:
            cb()
