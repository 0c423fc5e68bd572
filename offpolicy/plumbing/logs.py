"""Logging set-up: every line names the daemon (and rank), so merged logs stay readable."""

from __future__ import annotations

import logging
import sys
import time


def setup_logging(daemon: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {daemon} %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RateLimitedLog:
    """Warnings at most once per `interval_s` per key; the next line says how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0):
        self.logger, self.interval_s = logger, interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        self.logger.warning(msg + (f" (and {n} more like it)" if n else ""), *args)
