"""Live progress of a run for the launcher: a rich progress bar on a terminal, plain lines otherwise.

`MetricsTail` follows the learner's metrics.jsonl while the learner writes it. A resumed learner
replaces that file (it cuts it back to its checkpoint's step, written beside and renamed into place),
so the tail notices a new file (inode) or a shorter one and reads it again from the start; it hands
out only complete lines, and a line that does not decode is skipped with a message, never a crash.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from offpolicy.config import Config


def _line(r: dict) -> str:
    """One step's line: step k (from 0) and the version it published, k + 1 (docs/architecture.md)."""
    return (f"step {r['step']:>4} -> v{r['version']:<4} reward {r['reward_mean']:.3f}  "
            f"tok/s {r['tokens_per_s']:,.0f}  staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})  "
            f"publish {r['publish_seconds'] * 1000:.1f} ms  {r['total_seconds']:.2f} s/step")


class MetricsTail:
    """New complete JSON rows of a JSONL file that its writer appends to and may replace."""

    def __init__(self, path: str | os.PathLike):
        self.path, self._ino, self._offset, self._rest = Path(path), None, 0, b""
        self.skipped = 0  # complete lines that were not JSON

    def rows(self) -> list[dict]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self._offset:  # a new file (a resume rewrote it)
                self._ino, self._offset, self._rest = st.st_ino, 0, b""
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._rest = (self._rest + data).split(b"\n")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                self.skipped += 1
        return out


def training_bar(total: int, console=None):
    """A rich bar for `total` steps: count, elapsed and remaining time on the bar's line, the step's figures
    (`detail`, from `_line`) on a line of their own, cut to the terminal's width (at 80 columns one line
    squeezed the count and times out)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
    from rich.progress import TimeRemainingColumn
    from rich.text import Text

    class TwoLines(Bar):
        def get_renderables(self):
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                yield Text(task.fields.get("detail", ""), no_wrap=True, overflow="ellipsis")

    bar = TwoLines(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=console)
    return bar, bar.add_task("train", total=total, detail="waiting for the first batch ...")


class Progress:
    def __init__(self, cfg: Config):
        self.total = cfg.learner.total_steps
        self.tty = sys.stdout.isatty()
        self._last_print = 0.0
        self._bar = None

    def __enter__(self) -> Progress:
        if self.tty:
            self._bar, self._task = training_bar(self.total)
            self._bar.start()
        else:
            print(f"training {self.total} steps ...", flush=True)
        return self

    def update(self, record: dict) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"] + 1, detail=_line(record))
        elif time.monotonic() - self._last_print > 5 or record["step"] + 1 == self.total:
            self._last_print = time.monotonic()
            print(_line(record), flush=True)

    def message(self, text: str, err: bool = False) -> None:
        """A line above the bar (on a terminal), else on stdout, or stderr with `err` (events: deaths, restarts)."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr if err else sys.stdout, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


class EvalProgress:
    """Prompts evaluated so far: a rich bar on a terminal, a plain line every 5 s (and at the end) otherwise."""

    def __init__(self, label: str):
        self.label, self.tty = label, sys.stdout.isatty()
        self._bar, self._last_print = None, 0.0

    def __enter__(self) -> EvalProgress:
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
            from rich.progress import TimeRemainingColumn

            self._bar = Bar(TextColumn(f"[bold]eval {self.label}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("prompts"), TimeElapsedColumn(), TimeRemainingColumn())
            self._bar.start()
            self._task = self._bar.add_task("", total=None)
        return self

    def __call__(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
        elif time.monotonic() - self._last_print > 5 or done == total:
            self._last_print = time.monotonic()
            print(f"eval {self.label}: {done}/{total} prompts", flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
