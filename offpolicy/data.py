"""Prompt data sets: the built-in synthetic digit tasks, or JSONL / Parquet files of prompts.

A data set is a sequence of `Prompt`s indexed by prompt id (its row). The hub's cursor walks the ids
in a seeded order per epoch; the data set itself is immutable. Synthetic prompts are generated from
(seed, id) on demand, so a data set of any size costs no memory and the same id is always the same
prompt.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from offpolicy.config import DataConfig, SyntheticConfig


@dataclass(frozen=True)
class Prompt:
    id: int
    text: str
    answer: str = ""  # reference answer for the reward function


class SyntheticDigits:
    """"<digits>=" prompts; the answer is the digits copied, reversed or sorted."""

    def __init__(self, cfg: SyntheticConfig):
        self.cfg = cfg

    def __len__(self) -> int:
        return self.cfg.num_prompts

    def __getitem__(self, i: int) -> Prompt:
        if not 0 <= i < len(self):
            raise IndexError(i)
        rng = random.Random(self.cfg.seed * 1_000_003 + i)
        digits = "".join(rng.choice("0123456789") for _ in range(self.cfg.length))
        answer = {"copy": digits, "reverse": digits[::-1], "sort": "".join(sorted(digits))}[self.cfg.task]
        return Prompt(id=i, text=digits + "=", answer=answer)


class RowsDataset:
    """Prompts read from rows of a JSONL or Parquet file."""

    def __init__(self, path: str, prompt_field: str, answer_field: str):
        rows = _read_rows(Path(path))
        if not rows:
            raise ValueError(f"data.source {path} holds no rows: give a file with at least one prompt")
        self.prompts = []
        for i, (line, row) in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"data.source {path} line {line} is a JSON {type(row).__name__}, not an object "
                                 f"with a {prompt_field!r} field")
            if prompt_field not in row:
                raise ValueError(f"data.source {path} line {line} has no field {prompt_field!r} "
                                 f"(has {', '.join(row)}): set data.prompt_field")
            self.prompts.append(Prompt(id=i, text=str(row[prompt_field]), answer=str(row.get(answer_field, ""))))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


def _read_rows(path: Path) -> list[tuple[int, object]]:
    """(line number, row) pairs; Parquet rows are numbered from 1."""
    if not path.exists():
        raise ValueError(f"data.source {path} does not exist: point it at a .jsonl or .parquet file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("data.source is a .parquet file but pyarrow is missing: pip install 'offpolicy[parquet]'") from None
        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"data.source {path} line {n} is not JSON: {e}") from None
    return rows


def load_dataset(cfg: DataConfig):
    if cfg.source == "synthetic":
        return SyntheticDigits(cfg.synthetic)
    return RowsDataset(cfg.source, cfg.prompt_field, cfg.answer_field)
