"""`<run dir>/trackers.json`: each tracker's run id and the last step it received, so that a resumed
run continues the same tracker run and never sends a step twice. Written atomically after each step."""

from __future__ import annotations

import json
import os
from pathlib import Path


class TrackerState:
    def __init__(self, path: Path, data: dict | None = None):
        self.path = path
        self.data: dict = data or {"runs": {}, "last_step": {}}

    @classmethod
    def load(cls, path: Path) -> TrackerState:
        """The state a run left; a fresh one when the run had no trackers (or a torn file)."""
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return cls(path)
        return cls(path, {"runs": data.get("runs", {}), "last_step": data.get("last_step", {})})

    def run(self, tracker: str) -> dict:
        """What a tracker keeps about its run (its id, ...); filled in by the tracker."""
        return self.data["runs"].setdefault(tracker, {})

    def last_step(self, tracker: str) -> int:
        return self.data["last_step"].get(tracker, -1)

    def set_last_step(self, tracker: str, step: int) -> None:
        self.data["last_step"][tracker] = step

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)
