"""Logging set-up: every line names the daemon (and rank), so merged logs stay readable."""

from __future__ import annotations

import logging
import sys


def setup_logging(daemon: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {daemon} %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
