"""Chaos drills (`run.chaos`): `offpolicy run` kills its own processes on a seeded schedule and reports what it cost.

`Chaos.tick(now, procs, steps, resumable, spare)` (`resumable()`: whether the learner has a checkpoint;
`spare(proc)`: whether its restart unit has restarts left, so that a drill never ends a run by itself) is called on every turn of the launcher's loop. About every
`run.chaos.every_s` seconds (each gap drawn uniformly from 0.5-1.5x, from `run.chaos.seed`), once `after_steps`
training steps are done and the run has trained a step since the last kill (kills faster than the run recovers
would test nothing but the restart budget), it sends `run.chaos.signal` to one running process: the kinds in `targets` take turns in
a seeded order (so a drill of four kills with two targets kills each kind twice), the process within a kind is
drawn at random, a kind with nothing to kill is skipped, and the learner is a target only once it has a checkpoint
to resume from (without one its death stops the run, by design). Each kill is a line of `<run dir>/chaos.jsonl`
(its time, process, pid, signal and the steps done then); the launcher supervises the victim like any other
death.

`Chaos.report(step_seen)` turns the kills and the times at which the launcher first saw each training step into the
cost: a kill's stall is the time from the kill until the next step past the steps done at the kill, less the run's
median step interval (what that step would have taken anyway); per kind the mean and largest. The launcher writes
it to `<run dir>/chaos.json` and prints one line. The undisturbed throughput to compare with is a run of the
same seed with `run.chaos.every_s=0` (docs/operations.md, Chaos).
"""

from __future__ import annotations

import json
import os
from collections import Counter
import random
import signal
import statistics
import time
from pathlib import Path

from offpolicy.config import ChaosConfig


def kind(name: str) -> str:
    """The chaos kind of a supervised process name: learner (any rank), rollout, vllm, sglang, eval."""
    if name.startswith("learner"):
        return "learner"
    return name.split("-", 1)[0]


class Chaos:
    def __init__(self, cfg: ChaosConfig, run_dir: Path, now: float, total_steps: int | None = None):
        self.cfg, self.file, self.total_steps = cfg, run_dir / "chaos.jsonl", total_steps
        self.rng = random.Random(cfg.seed)
        self.order = list(cfg.targets)
        self.rng.shuffle(self.order)
        self.turn = 0
        self.kills: list[dict] = []
        self.next_at = now + self._gap()

    @property
    def on(self) -> bool:
        return self.cfg.every_s > 0 and (not self.cfg.max_kills or len(self.kills) < self.cfg.max_kills)

    def _gap(self) -> float:
        return self.cfg.every_s * self.rng.uniform(0.5, 1.5)

    def tick(self, now: float, procs: dict, steps: int, resumable, spare=lambda proc: True) -> dict | None:
        """Kill one process if one is due (module doc); returns the kill's record, or None."""
        if not self.on or now < self.next_at or steps < self.cfg.after_steps:
            return None
        if self.kills and steps <= self.kills[-1]["steps"]:  # the run has not trained a step since the last kill
            return None
        if self.total_steps is not None and steps >= self.total_steps:  # trained out: the run is ending
            return None
        self.next_at = now + self._gap()
        for _ in range(len(self.order)):
            want = self.order[self.turn % len(self.order)]
            self.turn += 1
            if want == "learner" and not resumable():  # asked only when the learner's turn comes
                continue
            killed = {k["pid"] for k in self.kills}  # a victim may not have died yet: never the same pid twice
            running = sorted((n for n, p in procs.items()
                              if kind(n) == want and p.running() and p.pid not in killed and spare(p)),
                             key=lambda n: (n != "learner", n))  # the learner's rank 0 first, then its workers
            if not running:
                continue
            name = "learner" if want == "learner" and "learner" in running else self.rng.choice(running)
            proc = procs[name]
            try:
                os.kill(proc.pid, getattr(signal, self.cfg.signal))
            except ProcessLookupError:  # it died on its own meanwhile: the launcher sees that death
                return None
            record = dict(time=round(time.time(), 3), monotonic=now, name=name, pid=proc.pid, signal=self.cfg.signal,
                          steps=steps, kill=len(self.kills) + 1)
            self.kills.append(record)
            with open(self.file, "a") as f:
                f.write(json.dumps({k: v for k, v in record.items() if k != "monotonic"}) + "\n")
            return record
        return None

    def report(self, step_seen: dict[int, float]) -> dict:
        """The kills' stalls against the launcher's monotonic time of first seeing each step (step -> time)."""
        times = [step_seen[s] for s in sorted(step_seen)]
        gaps = [b - a for a, b in zip(times, times[1:])]
        usual = statistics.median(gaps) if gaps else 0.0
        rows = []
        for k in self.kills:  # the first step past those done at the kill, seen after it
            after = min((t for s, t in step_seen.items() if s >= k["steps"] and t > k["monotonic"]), default=None)
            stall = None if after is None else max(0.0, after - k["monotonic"] - usual)
            rows.append(dict(name=k["name"], kind=kind(k["name"]), steps=k["steps"],
                             stall_s=None if stall is None else round(stall, 2)))
        by_kind = {}
        for r in rows:
            if r["stall_s"] is not None:
                by_kind.setdefault(r["kind"], []).append(r["stall_s"])
        return dict(kills=len(rows), usual_step_s=round(usual, 3),
                    kills_by_kind=dict(Counter(r["kind"] for r in rows)),  # also a kill no step came after
                    stall_mean_s={k: round(statistics.fmean(v), 2) for k, v in by_kind.items()},
                    stall_max_s={k: max(v) for k, v in by_kind.items()}, each=rows)
