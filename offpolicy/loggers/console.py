"""The `console` logger: one line per logged step in the learner's log (the default of run.loggers)."""

from __future__ import annotations

import logging

log = logging.getLogger("offpolicy.trackers.console")

SHOWN = ("reward_mean", "loss", "approx_kl", "entropy", "clip_frac", "response_len_mean", "staleness_mean",
         "tokens_per_s", "total_seconds")  # the fields of a line, those the record has, in this order


class ConsoleLogger:
    def start(self, state, config: dict, resume: bool) -> None:
        pass

    def log(self, step: int, values: dict[str, float]) -> None:
        shown = "  ".join(f"{k} {values[k]:.4g}" for k in SHOWN if k in values)
        log.info("step %d  %s", step, shown)

    def close(self) -> None:
        pass
