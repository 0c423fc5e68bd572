"""`<run dir>/trackers.json`: each tracker's run id and the last step it received, so that a resumed
run continues the same tracker run and never sends a step twice. Written atomically after each step;
the trackers' threads share one `TrackerState` (every method takes its lock)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from offpolicy.plumbing.files import write_atomic


class TrackerState:
    def __init__(self, path: Path, data: dict | None = None):
        self.path = path
        self.data: dict = data or {"runs": {}, "last_step": {}}
        self._lock = threading.RLock()

    @classmethod
    def load(cls, path: Path) -> TrackerState:
        """The state a run left; a fresh one when the run had no trackers (or a torn file)."""
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return cls(path)
        return cls(path, {"runs": data.get("runs", {}), "last_step": data.get("last_step", {})})

    def run(self, tracker: str) -> dict:
        """A copy of what a tracker keeps about its run (its id, ...)."""
        with self._lock:
            return dict(self.data["runs"].get(tracker, {}))

    def update_run(self, tracker: str, **fields) -> None:
        with self._lock:
            self.data["runs"].setdefault(tracker, {}).update(fields)

    def last_step(self, tracker: str) -> int:
        with self._lock:
            return self.data["last_step"].get(tracker, -1)

    def set_last_step(self, tracker: str, step: int) -> None:
        with self._lock:
            self.data["last_step"][tracker] = step

    def save(self) -> None:
        with self._lock:
            write_atomic(self.path, json.dumps(self.data, indent=1) + "\n")
