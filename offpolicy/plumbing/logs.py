"""Logging set-up: every line names the daemon (and rank), so merged logs stay readable."""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

PROCESS_PREFIX = re.compile(r"^\([\w.-]+ pid=\d+\) ")  # vLLM's "(EngineCore_DP0 pid=123) " before its processes' lines
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b")
TRACEBACK_LINES = 60  # at most this many lines of the first traceback


def setup_logging(daemon: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {daemon} %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


@contextmanager
def kept_root_logging(library: str) -> Iterator[None]:
    """The root logger's handlers and level as they were before the block, for a library that reconfigures them when
    it starts inside our process: `sglang.Engine` runs `logging.basicConfig(level=log_level, force=True)` (0.5.14
    `srt/utils/common.py:1357-1375`, called from `entrypoints/engine.py:771`), with `log_level` "error" unless given
    (`engine.py:212-214`), which would drop the daemon's handler and every offpolicy line below ERROR. The level the
    library set on the root goes to its own logger (`library`) where that has none, so its verbosity stays as asked."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        own = logging.getLogger(library)
        if root.level != level and own.level == logging.NOTSET:
            own.setLevel(root.level)
        root.handlers[:] = handlers
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


def dead_process_log(text: str, tail: int = 3000) -> str:
    """What the log of a process that died says about why: its first Python traceback, then its last `tail`
    characters. A vLLM server's log ends with its API server's traceback, "Engine core initialization failed. See
    root cause above": the root cause is the engine core's traceback, lines earlier, which the end alone cut off (on
    the H200 a server that failed at start showed only the API server's frames)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if PROCESS_PREFIX.sub("", line).startswith("Traceback (most recent call last)")), None)
    end = text[-tail:]
    if start is None:
        return end
    block = lines[start:start + TRACEBACK_LINES]
    for n, line in enumerate(block):
        if EXCEPTION_LINE.match(PROCESS_PREFIX.sub("", line)):
            block = block[:n + 1]
            break
    first = "\n".join(block)
    if first in end:
        return end
    return f"its first traceback:\n{first}\n[...]\nits end:\n{end}"
