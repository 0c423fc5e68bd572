"""A run that makes no progress says so: no training step for run.supervise.stall_timeout_s.

`StallWatch` is fed the time of every training step the launcher sees (metrics.jsonl) and asked, on each
turn of the launcher's loop, whether the run is stalled. A stall is reported once when it starts and again
every stall_timeout_s while it lasts, with the cause the launcher can see (the launcher's `cause()`: the
learner down, every rollout daemon down, every vLLM server down, else the newest warning each process
logged), and in `offpolicy_launcher_stalled{cause}`; the first step after it is reported too. The gauge
`offpolicy_launcher_seconds_since_step` is kept current either way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from offpolicy.plumbing.metrics import LauncherMetrics

_LEVEL = re.compile(r" (WARNING|ERROR|CRITICAL) ")


def last_warning(log: Path, tail_bytes: int = 65536) -> str | None:
    """The newest WARNING/ERROR line of a daemon's log (its last `tail_bytes`), without the timestamp."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        m = _LEVEL.search(line)
        if m:
            return line[m.start() + 1:].strip()[:300]
    return None


class StallWatch:
    def __init__(self, timeout_s: float, metrics: LauncherMetrics, now: float):
        self.timeout_s, self.m = timeout_s, metrics
        self.last_step = now  # the start counts as progress: the first step may take the whole start-up
        self.reported_at: float | None = None  # when the current stall was last reported; None = not stalled

    def step(self, now: float) -> str | None:
        """A training step came; a message if it ends a reported stall."""
        quiet, self.last_step = now - self.last_step, now
        if self.reported_at is None:
            return None
        self.reported_at = None
        for cause in LauncherMetrics.CAUSES:
            self.m.stalled.labels(cause).set(0)
        return f"training goes on again after {quiet:.0f} s without a step"

    def check(self, now: float, cause) -> str | None:
        """A message when the run is stalled and it is time to say so; `cause()` -> (cause label, text)."""
        quiet = now - self.last_step
        self.m.since_step.set(quiet)
        if not self.timeout_s or quiet < self.timeout_s:
            return None
        if self.reported_at is not None and now - self.reported_at < self.timeout_s:
            return None
        self.reported_at = now
        label, text = cause()
        for c in LauncherMetrics.CAUSES:
            self.m.stalled.labels(c).set(1 if c == label else 0)
        return (f"no training step for {quiet:.0f} s (run.supervise.stall_timeout_s={self.timeout_s:.0f}): {text}")
