"""Experiment trackers (`run.loggers`): every scalar of a metrics.jsonl line goes to each configured
tracker at its optimizer step, and the resolved config once, beside the run directory's own files.

`open_trackers(cfg, run_dir, resume)` builds the configured loggers (`console`, `wandb`, `tensorboard`,
`mlflow`; each library is imported only here, and only when its logger is configured) and returns a
`Trackers` that sends to each from a background thread of its own. So a tracker never stops or slows
training, nor holds up another: `log` only queues (a full queue drops the record and warns once), and
a tracker that fails (no network, a full disk, a library error) is warned about once, with the error,
and left out from then on; metrics.jsonl keeps every record either way.

One tracker run per run directory: `<run dir>/trackers.json` keeps each tracker's run id and the last
step it received. A resumed learner opens the same tracker run again and sends only steps after that
last one, so no step goes backwards (steps redone after a crash keep the tracker's first values;
metrics.jsonl has the redone ones).

The eval daemon (role "eval") sends each evaluated version's results (`eval/pass_at_<k>` for each k,
`eval/reward_mean`, ...) at step = the weight version, with its own state file `trackers-eval.json`: into the learner's
MLflow run (its id read from trackers.json) and TensorBoard directory, and into a W&B run of its own in
the learner run's group (one process per W&B run), `<run.name>-eval`.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from pathlib import Path

from offpolicy.config import Config
from offpolicy.loggers.state import TrackerState

log = logging.getLogger("offpolicy.trackers")

QUEUE_RECORDS = 10_000  # records waiting for one slow tracker; past it its records are dropped (warned once)


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a metrics.jsonl record, as floats (step and version are the axes)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and k not in ("step",)}


def eval_scalars(record: dict) -> dict[str, float]:
    """An eval.jsonl record as tracker scalars: eval/pass_at_<k> (MLflow allows no @ in names), eval/reward_mean, ... (skipped versions: none)."""
    if "pass_at_k" not in record:
        return {}
    out = {f"eval/pass_at_{k}": float(v) for k, v in record["pass_at_k"].items()}
    for key in ("reward_mean", "response_tokens_mean", "seconds", "samples_per_s"):
        if key in record:
            out[f"eval/{key}"] = float(record[key])
    return out


def make_logger(name: str, cfg: Config, run_dir: Path, role: str = "learner"):
    """The logger object of one `run.loggers` entry; its library is imported when it starts."""
    if name == "console":
        from offpolicy.loggers.console import ConsoleLogger

        return ConsoleLogger()
    if name == "wandb":
        from offpolicy.loggers.wandb_run import WandbLogger

        return WandbLogger(cfg, run_dir, role)
    if name == "tensorboard":
        from offpolicy.loggers.tensorboard_run import TensorBoardLogger

        return TensorBoardLogger(cfg, run_dir)
    if name == "mlflow":
        from offpolicy.loggers.mlflow_run import MlflowLogger

        return MlflowLogger(cfg, run_dir, role)
    raise ValueError(f"run.loggers: unknown logger {name!r}; use console, wandb, tensorboard or mlflow")


class Trackers:
    """The configured loggers, each fed from its own background thread and queue, so that one slow or
    stuck tracker holds up neither training nor the other trackers (see the module docstring)."""

    def __init__(self, loggers: dict, state: TrackerState, config: dict, resume: bool):
        self.loggers, self.state, self.config, self.resume = dict(loggers), state, config, resume
        self._queues = {name: queue.Queue(QUEUE_RECORDS) for name in self.loggers}
        self._dropped = dict.fromkeys(self.loggers, 0)
        self._threads = [threading.Thread(target=self._run, args=(name, logger), name=f"tracker-{name}", daemon=True)
                         for name, logger in self.loggers.items()]
        for t in self._threads:
            t.start()

    def log(self, step: int, record: dict, values: dict[str, float] | None = None) -> None:
        """Queue one step's scalars (`values`, else the numbers of `record`) for every tracker; never blocks."""
        values = scalars(record) if values is None else values
        for name, q in self._queues.items():
            try:
                q.put_nowait((step, values))
            except queue.Full:
                self._dropped[name] += 1
                if self._dropped[name] == 1:
                    log.warning("tracker %s is %d records behind: dropping its step records until it catches up "
                                "(metrics.jsonl has every one)", name, QUEUE_RECORDS)

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued, finish every tracker run; gives up after `timeout_s` in all (warned)."""
        deadline = time.monotonic() + timeout_s
        for q in self._queues.values():
            # a full queue waits for its thread to make room (a slow tracker catching up); one still full at
            # the deadline is stuck, and the join below says so
            with contextlib.suppress(queue.Full):
                q.put(None, timeout=max(0.0, deadline - time.monotonic()))
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name.removeprefix("tracker-") for t in self._threads if t.is_alive()]
        if stuck:
            log.warning("trackers %s did not finish within %.0f s; their last records may be missing "
                        "(metrics.jsonl has them)", ", ".join(stuck), timeout_s)

    def _call(self, name: str, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        # A tracker library can fail in any way it likes (network, disk, its own bugs); none of that may
        # stop training, so the boundary to third-party trackers catches everything, once per tracker.
        except Exception as e:  # noqa: BLE001
            log.warning("tracker %s failed to %s and is left out for the rest of this run (training goes on; "
                        "metrics.jsonl has every step): %s: %s", name, what, type(e).__name__, e)
            return False

    def _save(self, name: str | None = None, step: int | None = None) -> None:
        if name is not None:
            self.state.set_last_step(name, step)
        self.state.save()

    def _run(self, name: str, logger) -> None:
        q = self._queues[name]
        last = self.state.last_step(name)
        ok = self._call(name, "start", logger.start, self.state, self.config, self.resume)
        if ok:
            self._save()
        while (item := q.get()) is not None:
            step, values = item
            if not ok or step <= last:
                continue  # failed: drain; or a resumed run redoing steps this tracker has: never go backwards
            ok = self._call(name, "log", logger.log, step, values)
            if ok:
                last = step
                self._save(name, step)
        if ok:
            self._call(name, "finish", logger.close)


def open_trackers(cfg: Config, run_dir: Path, resume: bool, config: dict, role: str = "learner") -> Trackers:
    """The trackers of `run.loggers` for the run in `run_dir` (resumed: the same tracker runs). Role "eval":
    the eval daemon's (no console: it logs each version itself), always continuing its own state."""
    t0 = time.perf_counter()
    names = [n for n in dict.fromkeys(cfg.run.loggers) if role == "learner" or n != "console"]
    loggers = {name: make_logger(name, cfg, run_dir, role) for name in names}
    path = run_dir / ("trackers.json" if role == "learner" else f"trackers-{role}.json")
    state = TrackerState.load(path) if resume else TrackerState(path)
    trackers = Trackers(loggers, state, config, resume)
    log.debug("trackers %s set up in %.3f s", ", ".join(loggers), time.perf_counter() - t0)
    return trackers
