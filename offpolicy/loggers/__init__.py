"""Experiment trackers (`run.loggers`): every scalar of a metrics.jsonl line goes to each configured
tracker at its optimizer step, and the resolved config once, beside the run directory's own files.

`open_trackers(cfg, run_dir, resume)` builds the configured loggers (`console`, `wandb`, `tensorboard`,
`mlflow`; each library is imported only here, and only when its logger is configured) and returns a
`Trackers` that sends to them from one background thread. So a tracker never stops or slows training:
`log` only queues (a full queue drops the record and warns once), and a tracker that fails (no
network, a full disk, a library error) is warned about once, with the error, and left out from then
on; metrics.jsonl keeps every record either way.

One tracker run per run directory: `<run dir>/trackers.json` keeps each tracker's run id and the last
step it received. A resumed learner opens the same tracker run again and sends only steps after that
last one, so no step goes backwards (steps redone after a crash keep the tracker's first values;
metrics.jsonl has the redone ones).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from offpolicy.config import Config
from offpolicy.loggers.state import TrackerState

log = logging.getLogger("offpolicy.trackers")

QUEUE_RECORDS = 10_000  # records waiting for slow trackers; past it records are dropped (warned once)


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a metrics.jsonl record, as floats (step and version are the axes)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and k not in ("step",)}


def make_logger(name: str, cfg: Config, run_dir: Path):
    """The logger object of one `run.loggers` entry; its library is imported when it starts."""
    if name == "console":
        from offpolicy.loggers.console import ConsoleLogger

        return ConsoleLogger()
    if name == "wandb":
        from offpolicy.loggers.wandb_run import WandbLogger

        return WandbLogger(cfg, run_dir)
    if name == "tensorboard":
        from offpolicy.loggers.tensorboard_run import TensorBoardLogger

        return TensorBoardLogger(cfg, run_dir)
    if name == "mlflow":
        from offpolicy.loggers.mlflow_run import MlflowLogger

        return MlflowLogger(cfg, run_dir)
    raise ValueError(f"run.loggers: unknown logger {name!r}; use console, wandb, tensorboard or mlflow")


class Trackers:
    """The configured loggers, fed from one background thread (see the module docstring)."""

    def __init__(self, loggers: dict, state: TrackerState, config: dict, resume: bool):
        self.loggers, self.state, self.config, self.resume = dict(loggers), state, config, resume
        self._queue: queue.Queue = queue.Queue(QUEUE_RECORDS)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="trackers", daemon=True)
        self._thread.start()

    def log(self, step: int, record: dict) -> None:
        """Queue one step's scalars for every tracker; never blocks."""
        try:
            self._queue.put_nowait((step, scalars(record)))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("trackers are %d records behind: dropping step records until they catch up "
                            "(metrics.jsonl has every one)", QUEUE_RECORDS)

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued, finish every tracker run; gives up after `timeout_s` (warned)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trackers %s did not finish within %.0f s; their last records may be missing "
                        "(metrics.jsonl has them)", ", ".join(self.loggers), timeout_s)

    def _call(self, name: str, what: str, fn, *args) -> None:
        if name not in self.loggers:
            return
        try:
            fn(*args)
        # A tracker library can fail in any way it likes (network, disk, its own bugs); none of that may
        # stop training, so the boundary to third-party trackers catches everything, once per tracker.
        except Exception as e:  # noqa: BLE001
            del self.loggers[name]
            log.warning("tracker %s failed to %s and is left out for the rest of this run (training goes on; "
                        "metrics.jsonl has every step): %s: %s", name, what, type(e).__name__, e)

    def _run(self) -> None:
        for name, logger in list(self.loggers.items()):
            self._call(name, "start", logger.start, self.state, self.config, self.resume)
        self.state.save()
        while (item := self._queue.get()) is not None:
            step, values = item
            for name, logger in list(self.loggers.items()):
                if step <= self.state.last_step(name):
                    continue  # a resumed run redoing steps this tracker has: never go backwards
                self._call(name, "log", logger.log, step, values)
                if name in self.loggers:
                    self.state.set_last_step(name, step)
            self.state.save()
        for name, logger in list(self.loggers.items()):
            self._call(name, "finish", logger.close)
        self.state.save()


def open_trackers(cfg: Config, run_dir: Path, resume: bool, config: dict) -> Trackers:
    """The trackers of `run.loggers` for the run in `run_dir` (resumed: the same tracker runs)."""
    t0 = time.perf_counter()
    loggers = {name: make_logger(name, cfg, run_dir) for name in dict.fromkeys(cfg.run.loggers)}
    state = TrackerState.load(run_dir / "trackers.json") if resume else TrackerState(run_dir / "trackers.json")
    trackers = Trackers(loggers, state, config, resume)
    log.debug("trackers %s set up in %.3f s", ", ".join(loggers), time.perf_counter() - t0)
    return trackers
