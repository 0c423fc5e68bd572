"""The restart policy of supervised processes (`run.supervise`): a budget per process, and a backoff.

One policy for `offpolicy run` (offpolicy/launch/supervisor.py) and the Slurm task wrapper
(services/supervise_task.py). Pure bookkeeping, no processes: `RestartPolicy.decide(name, now, proven)` says
whether the process `name`, found dead at `now`, may be restarted and after how long. Invariants:
- at most `max_restarts` restarts per process within any `restart_window_s` (0: over the whole run);
  the death that would need one more is refused (`Decision.allowed` False), so `max_restarts=0` stops at
  the first unexpected exit;
- the backoff is for a process that cannot get going (a bad config, a busy port, a server not up yet): the
  wait before its k-th such restart within the window is backoff_s * 2**(k-1), at most max_backoff_s; a
  process that stayed up for a whole window starts again at backoff_s. A `proven` death (the caller saw the
  process do its work since its start: the run trained a step) is restarted at once and does not add to the
  backoff (as supervisord restarts a process that reached RUNNING at once); it counts against the budget;
- `restart=False` refuses every restart (the caller decides what a death then means).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from offpolicy.config import SuperviseConfig


@dataclass(frozen=True)
class Decision:
    allowed: bool  # the process may be restarted
    delay_s: float  # wait this long first
    count: int  # which restart of this process within the window this is (1 = the first); when refused: the used ones
    reason: str  # why not (when refused): names the config field to change


class RestartPolicy:
    def __init__(self, cfg: SuperviseConfig):
        self.cfg = cfg
        self.history: dict[str, deque[float]] = defaultdict(deque)  # restart times per process, within the window
        self.unproven: dict[str, deque[float]] = defaultdict(deque)  # those of them after a death not `proven`

    def _used(self, name: str, now: float) -> deque[float]:
        times = self.history[name]
        window = self.cfg.restart_window_s
        while window and times and now - times[0] > window:
            times.popleft()
        return times

    def left(self, name: str, now: float) -> int:
        """Restarts process `name` may still have at `now` (0: its next death stops the run)."""
        return max(0, self.cfg.max_restarts - len(self._used(name, now))) if self.cfg.restart else 0

    def decide(self, name: str, now: float, proven: bool = False) -> Decision:
        """Process `name` died at `now` (monotonic seconds): may it come back, and when? `proven`: it did its work
        since it started (module doc): no backoff. An allowed restart is counted at once."""
        c = self.cfg
        if not c.restart:
            return Decision(False, 0.0, 0, "run.supervise.restart is false")
        times = self._used(name, now)
        if len(times) >= c.max_restarts:
            window = f"within run.supervise.restart_window_s={c.restart_window_s:.0f} s" if c.restart_window_s else \
                "in this run"
            return Decision(False, 0.0, len(times), f"its restart budget is spent: {len(times)} restart(s) {window}, "
                                                    f"run.supervise.max_restarts={c.max_restarts}")
        times.append(now)
        if proven:
            return Decision(True, 0.0, len(times), "")
        slow = self.unproven[name]
        while c.restart_window_s and slow and now - slow[0] > c.restart_window_s:
            slow.popleft()
        slow.append(now)
        delay = min(c.max_backoff_s, c.backoff_s * 2 ** (len(slow) - 1))
        return Decision(True, delay, len(times), "")
