"""The run directory: `metrics.jsonl` (one line per step), `trained.jsonl` (one line per trained
group: the audit trail for staleness and exactly-once), `summary.json` at the end, `config.yaml`,
`checkpoints/`. Every metrics.jsonl line also goes to the experiment trackers of `run.loggers`
(`offpolicy.loggers`: console, wandb, tensorboard, mlflow), with the resolved config once.

A directory left by an earlier run of the same name is moved aside (never overwritten), unless the
learner resumes it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import msgspec

from offpolicy.config import Config, to_yaml
from offpolicy.hub.batch import Group
from offpolicy.loggers.trackers import open_trackers
from offpolicy.plumbing.files import write_atomic

log = logging.getLogger("offpolicy.runlog")


def run_path(cfg: Config) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def prepare_run_dir(path: Path) -> Path:
    """Create `path`; if an earlier run left results there, move that directory aside first."""
    if (path / "metrics.jsonl").exists() or (path / "summary.json").exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((path / "config.yaml").stat().st_mtime
                                                              if (path / "config.yaml").exists() else time.time()))
        aside = path.with_name(f"{path.name}-{stamp}")
        os.rename(path, aside)
        log.info("moved the previous run directory aside to %s", aside)
    path.mkdir(parents=True, exist_ok=True)
    return path


class RunLog:
    """Appends to the run directory's logs. `resume_step=S` keeps the existing run and cuts its logs
    back to the steps before S (the ones a checkpoint of step S contains); they are in `kept`."""

    def __init__(self, cfg: Config, resume_step: int | None = None):
        self.kept: dict[str, list[dict]] = {"metrics": [], "trained": []}
        if resume_step is None:
            self.dir = prepare_run_dir(run_path(cfg))
        else:
            self.dir = run_path(cfg)
            for name in self.kept:
                self.kept[name] = _truncate(self.dir / f"{name}.jsonl", resume_step)
        (self.dir / "config.yaml").write_text(to_yaml(cfg))
        self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._trained = open(self.dir / "trained.jsonl", "a", buffering=1)
        self.trackers = open_trackers(cfg, self.dir, resume=resume_step is not None, config=msgspec.to_builtins(cfg))

    def step(self, record: dict) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self.trackers.log(record["step"], record)

    def trained(self, step: int, groups: list[Group]) -> None:
        for g in groups:
            self._trained.write(json.dumps({"step": step, "epoch": g.epoch, "prompt_id": g.prompt_id,
                                            "lease_id": g.lease_id, "version": g.weight_version,
                                            "newest_version": g.newest_version, "daemon": g.daemon}) + "\n")

    def summary(self, summary: dict) -> None:
        write_atomic(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        self.trackers.close()
        self._metrics.close()
        self._trained.close()


def _truncate(path: Path, step: int) -> list[dict]:
    """Rewrite `path` (atomically) with only its lines of steps < `step`; returns them."""
    rows = [r for r in read_jsonl(path, tolerate_torn_tail=True) if r["step"] < step] if path.exists() else []
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_jsonl(path: str | os.PathLike, tolerate_torn_tail: bool = False) -> list[dict]:
    """Rows of a JSONL file; with `tolerate_torn_tail`, a last line cut short by a crash is skipped."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if not (tolerate_torn_tail and i == len(lines) - 1):
                raise
            log.warning("%s: skipped a last line cut short by a crash", path)
    return rows
