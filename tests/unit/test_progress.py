"""The launcher's metrics.jsonl tail, on the exact sequence a resumed learner writes: the file cut back and
replaced (renamed into place) while the launcher follows it, then appended to, lines arriving in pieces."""

from __future__ import annotations

import json
import os

import pytest

from offpolicy.launch.progress import MetricsTail


def rows(n0: int, n1: int) -> str:
    return "".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in range(n0, n1))


def test_follows_a_file_replaced_shorter_and_appended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.rows() == []  # no file yet
    path.write_text(rows(0, 12))
    assert [r["step"] for r in tail.rows()] == list(range(12))
    tmp = tmp_path / "metrics.jsonl.tmp"  # the resume: steps >= 10 cut, renamed into place
    tmp.write_text(rows(0, 10))
    os.replace(tmp, path)
    with open(path, "a") as f:
        f.write(rows(10, 11))
        f.write('{"step": 11, "rew')  # half a line: not handed out yet
        f.flush()
        assert [r["step"] for r in tail.rows()] == list(range(11))
        f.write('ard_mean": 0.5}\n')
    assert [r["step"] for r in tail.rows()] == [11]
    assert tail.rows() == [] and tail.skipped == 0


def test_a_file_truncated_in_place_and_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(0, 5))
    tail = MetricsTail(path)
    assert len(tail.rows()) == 5
    with open(path, "r+") as f:  # same inode, shorter
        f.truncate(0)
        f.write(rows(0, 2) + "not json\n")
    assert [r["step"] for r in tail.rows()] == [0, 1] and tail.skipped == 1


def test_the_progress_line_says_step_k_published_version_k_plus_1():
    """docs/architecture.md "Steps and versions": step k (from 0) publishes version k + 1."""
    from offpolicy.launch.progress import _line

    row = {"step": 299, "version": 300, "reward_mean": 0.998, "tokens_per_s": 5512.0, "staleness_mean": 1.0,
           "staleness_max": 1, "publish_seconds": 0.0018, "total_seconds": 0.19}
    assert _line(row) == ("step  299 -> v300  reward 0.998  tok/s 5,512  staleness 1.00 (max 1)  publish 1.8 ms  "
                          "0.19 s/step")


@pytest.mark.parametrize("width", [80, 200])
def test_the_bar_keeps_its_count_and_times_at_80_columns(width):
    from rich.console import Console

    from offpolicy.launch.progress import _line, training_bar

    console = Console(width=width, record=True, force_terminal=True)
    bar, task = training_bar(300, console)
    row = {"step": 149, "version": 150, "reward_mean": 0.5, "tokens_per_s": 12345.0, "staleness_mean": 0.9,
           "staleness_max": 1, "publish_seconds": 0.0123, "total_seconds": 1.23}
    bar.update(task, completed=150, detail=_line(row))
    console.print(bar.get_renderable())
    first, second = console.export_text().splitlines()
    assert "150/300" in first and "0:00:00" in first and len(first) <= width
    assert second.startswith("step  149 -> v150  reward 0.500") and len(second) <= width
    assert second.endswith("1.23 s/step") == (width == 200)  # cut to the width, never wrapped
