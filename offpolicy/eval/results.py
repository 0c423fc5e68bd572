"""Results of one evaluation: the resumable per-prompt file and the report (JSON + markdown).

`ResultsFile(path, meta)` is `results.jsonl` in an evaluation's output directory: a first line
`{"kind": "meta", ...}` with everything that decides the samples (weights, data, reward, sampling),
then one `{"kind": "prompt", ...}` line per evaluated prompt (its rewards, response lengths, finish
reasons and, if kept, the responses), appended and flushed as each batch finishes. Opening an existing
file resumes it: prompts already in it are skipped; a file written under other settings is refused
(the message names the settings). A line cut short by a crash is dropped, so that prompt runs again.

`report(...)` turns the records into per-prompt and overall pass@k, mean reward and mean response
length (`offpolicy.eval.passk`), with the prompt counts and the generation throughput; `markdown(report)`
renders it as tables. k and the pass threshold only enter the report, so they may change on resume.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from offpolicy.eval.passk import overall, prompt_summary

log = logging.getLogger("offpolicy.eval")


class ResultsFile:
    def __init__(self, path: str | os.PathLike, meta: dict):
        self.path = Path(path)
        self.meta = meta
        self.records: dict[int, dict] = {}
        if self.path.exists() and self.path.stat().st_size:
            self._resume()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(json.dumps({"kind": "meta", **meta}) + "\n")

    def _resume(self) -> None:
        lines = self.path.read_text().splitlines()
        head = json.loads(lines[0])
        if head.get("kind") != "meta":
            raise ValueError(f"{self.path} is not an offpolicy results file (no meta line): pick another output")
        differ = sorted(k for k in set(head) - {"kind"} | set(self.meta) if head.get(k) != self.meta.get(k))
        if differ:
            was = ", ".join(f"{k}={head.get(k)!r} (now {self.meta.get(k)!r})" for k in differ)
            raise ValueError(f"{self.path} holds results of other settings: {was}; remove it or write elsewhere "
                             "(--out)")
        good = len(lines[0]) + 1
        for line in lines[1:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s: dropping a cut-off line (its prompt runs again)", self.path)
                break
            self.records[rec["id"]] = rec
            good += len(line.encode()) + 1
        if good < self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)
        log.info("%s: resuming, %d prompts already evaluated", self.path, len(self.records))

    def done(self) -> set[int]:
        return set(self.records)

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a") as f:
            f.write("".join(json.dumps({"kind": "prompt", **r}) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        for r in records:
            self.records[r["id"]] = r


def report(records: list[dict], ks: list[int], threshold: float, meta: dict, counts: dict, throughput: dict) -> dict:
    """The evaluation's figures: per prompt (in `records` order) and overall (see the module doc)."""
    per_prompt = [{"id": r["id"], **prompt_summary(r["rewards"], r["lengths"], ks, threshold)} for r in records]
    return {**meta, "k": list(ks), "pass_threshold": threshold, "counts": counts, "overall": overall(per_prompt, ks),
            "throughput": throughput, "per_prompt": per_prompt}


def markdown(rep: dict, max_rows: int = 200) -> str:
    ks = rep["k"]
    o, c, t = rep["overall"], rep["counts"], rep["throughput"]
    head = "| " + " | ".join(["prompts", "samples", *(f"pass@{k}" for k in ks), "reward", "tokens"]) + " |"
    row = [o["prompts"], o["samples"], *(f"{o['pass_at_k'][str(k)]:.4f}" for k in ks), f"{o['reward_mean']:.4f}",
           f"{o['response_tokens_mean']:.1f}"]
    lines = [f"# Evaluation of {rep['weights']}", "",
             f"data `{rep['source']}`, reward `{rep['reward']}` (pass: reward >= {rep['pass_threshold']}), "
             f"n = {rep['n']} samples per prompt, temperature {rep['temperature']}, top_p {rep['top_p']}, "
             f"max_new_tokens {rep['max_new_tokens']}", "",
             f"prompts: {c['read']} read, {c['filtered_overlong']} filtered as overlong, {c['truncated']} truncated, "
             f"{c['kept']} kept, {c['evaluated']} evaluated", "",
             f"generation this session: {t['samples']} samples in {t['generate_seconds']:.1f} s = "
             f"{t['samples_per_s']:.1f} samples/s, {t['tokens_per_s']:.0f} tokens/s; scoring {t['reward_seconds']:.1f} s",
             "", "## Overall", "", head, "|" + " --- |" * len(row), "| " + " | ".join(map(str, row)) + " |", "",
             "## Per prompt", "", "| id | passed / n | " + " | ".join(f"pass@{k}" for k in ks) + " | reward | tokens |",
             "|" + " --- |" * (len(ks) + 4)]
    for p in rep["per_prompt"][:max_rows]:
        lines.append(f"| {p['id']} | {p['passed']} / {p['n']} | " + " | ".join(f"{p['pass_at_k'][str(k)]:.3f}" for k in ks)
                     + f" | {p['reward_mean']:.3f} | {p['response_tokens_mean']:.1f} |")
    if len(rep["per_prompt"]) > max_rows:
        lines.append(f"\n({len(rep['per_prompt']) - max_rows} more prompts in report.json)")
    return "\n".join(lines) + "\n"
