"""The eval daemon follows a real training run (`offpolicy run` of the quickstart: learner, two rollouts
and offpolicy-eval as subprocesses). Slower than training, it holds the versions it was asked for and
reports every one; frozen with SIGSTOP it holds the learner up in nothing (training finishes meanwhile),
and once thawed it accounts for every asked version: evaluated, or skipped because the store had
collected it while the daemon was frozen."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import psutil
import pytest

from tests.conftest import QUICKSTART
from tests.integration.helpers import check_run_invariants, read_jsonl, scrape, wait_for

EVAL = ["eval.n_samples=16", "eval.k=[1, 4, 16]", "eval.pass_threshold=0.5",
        "eval.max_pending_versions=20", "eval.finish_timeout_s=200"]


def start(run_overrides, *extra: str) -> subprocess.Popen:
    overrides = [o for o in run_overrides if not o.startswith("metrics.port")]
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *overrides,
           f"metrics.port={run_overrides.metrics_port}", *EVAL, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(launcher: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    return out


@pytest.mark.slow
def test_eval_daemon_follows_training_and_reports_every_asked_version(run_overrides):
    run_dir = run_overrides.run_dir / "quickstart"
    launcher = start(run_overrides, "learner.total_steps=32", "eval.every_versions=2",
                     "eval.data.synthetic={task: copy, length: 4, num_prompts: 96, seed: 1}")
    log = run_dir / "eval.jsonl"
    try:
        wait_for(lambda: log.exists() and read_jsonl(log), 120, "the eval daemon's first version")
        scraped = wait_for(lambda: scrape(run_overrides.metrics_port + 3), 30, "eval /metrics at metrics.port + 3")
        assert 'offpolicy_eval_pass_at_k{k="16"}' in scraped and scraped["offpolicy_eval_versions_total"] >= 1
    finally:
        out = finish(launcher)
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == 32
    rows = read_jsonl(log)
    assert [r["version"] for r in rows] == list(range(0, 33, 2))  # every 2nd, in order
    assert all("pass_at_k" in r and r["prompts"] == 96 and r["samples"] == 96 * 16 for r in rows)
    # it fell behind the learner: versions waited while 6+ newer ones were published (weights.keep is 3),
    # kept in the store only because the daemon held them
    assert max(r["waiting"] for r in rows) >= 3
    for r in rows:
        rep = json.loads((run_dir / r["report"]).read_text())
        assert rep["version"] == r["version"] and rep["overall"]["pass_at_k"] == r["pass_at_k"]
    assert (run_dir / "eval.png").stat().st_size > 10_000
    assert "eval: 17 versions evaluated" in out


@pytest.mark.slow
def test_a_frozen_eval_daemon_does_not_hold_the_learner_up(run_overrides):
    run_dir = run_overrides.run_dir / "quickstart"
    launcher = start(run_overrides, "learner.total_steps=30", "eval.every_versions=5",
                     "eval.data.synthetic={task: copy, length: 4, num_prompts: 8, seed: 1}")
    log = run_dir / "eval.jsonl"
    try:
        wait_for(lambda: log.exists() and read_jsonl(log), 120, "the eval daemon's first version")
        kids = psutil.Process(launcher.pid).children()
        frozen = psutil.Process(next(k.pid for k in kids if "offpolicy.services.eval_daemon" in " ".join(k.cmdline())))
        frozen.send_signal(signal.SIGSTOP)
        seen = len(read_jsonl(log))
        wait_for(lambda: (run_dir / "summary.json").exists(), 180, "the learner to finish while eval is frozen")
        assert len(read_jsonl(log)) == seen and seen < 7  # it was frozen while the learner finished
        frozen.send_signal(signal.SIGCONT)
    finally:
        finish(launcher)
    assert check_run_invariants(run_dir, 1)["steps"] == 30
    rows = read_jsonl(log)
    assert sorted(r["version"] for r in rows) == [0, 5, 10, 15, 20, 25, 30]  # each asked version, once
    evaluated = {r["version"] for r in rows if "pass_at_k" in r}
    assert {0, 30} <= evaluated  # the first before the freeze, the last still in the store after it
    assert all(r.get("skipped") == "collected" for r in rows if r["version"] not in evaluated)
