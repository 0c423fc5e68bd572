"""One strict poll for tests: the predicate's value once truthy, an AssertionError naming what was awaited once
`timeout` passes. Exceptions from the predicate propagate (a test that polls a daemon not up yet uses
tests/integration/helpers.wait_for, which tolerates them)."""

from __future__ import annotations

import time


def poll(predicate, timeout: float, what: str = "the condition", interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
