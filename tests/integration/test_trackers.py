"""Experiment trackers on real runs: `offpolicy run` with wandb (offline), TensorBoard and MLflow (local
stores) on, then resumed; what was logged is read back with each library's own reader and must equal
metrics.jsonl step for step, in one tracker run. A tracker that cannot be reached never stops training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, free_ports
from tests.integration.helpers import check_run_invariants, read_jsonl
from tests.wandb_records import history, run_info

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

LOGGERS = "run.loggers=[console, wandb, tensorboard, mlflow]"
EVAL = ["eval.every_versions=3", "eval.data.synthetic={task: copy, length: 4, num_prompts: 16, seed: 1}",
        "eval.n_samples=4", "eval.k=[1, 4]", "eval.max_pending_versions=20", "eval.finish_timeout_s=200"]
SERIES = ("reward_mean", "loss", "approx_kl", "tokens_per_s")


def offpolicy_run(overrides, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *overrides, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def wandb_series(run_dir: Path, run_id: str | None = None) -> tuple[set[str], list[dict]]:
    """Run ids and history rows of the offline-run folders (of `run_id`, else all), in start order."""
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id or ''}*/run-*.wandb"))
    assert files, f"no wandb offline run under {run_dir / 'wandb'}"
    return {run_info(f)["id"] for f in files}, [row for f in files for row in history(f)]


def tensorboard_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_series(run_dir: Path) -> tuple[list, dict[str, list[tuple[int, float]]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name("offpolicy")
    runs = client.search_runs([exp.experiment_id])
    series = {k: [(m.step, m.value) for m in sorted(client.get_metric_history(runs[0].info.run_id, k),
                                                     key=lambda m: (m.step, m.timestamp))]
              for k in (*SERIES, "eval/pass_at_1", "eval/reward_mean")}
    return runs, series


def check_series(name: str, got: dict[str, list[tuple[int, float]]], rows: list[dict]) -> None:
    for key in SERIES:
        want = [(r["step"], r[key]) for r in rows]
        assert [s for s, _ in got[key]] == [s for s, _ in want], f"{name} {key}: steps differ"
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want], rel=1e-5), f"{name} {key}: values differ"


@pytest.mark.slow  # three tracker libraries and a resumed run (~50 s); test_loggers checks the feeding and state
def test_trackers_log_every_step_and_a_resumed_run_continues_them(run_overrides):
    res = offpolicy_run(run_overrides, LOGGERS, "run.wandb.mode=offline", "learner.total_steps=6", *EVAL)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    learner_id = json.loads((run_dir / "trackers.json").read_text())["runs"]["wandb"]["id"]
    eval_id = json.loads((run_dir / "trackers-eval.json").read_text())["runs"]["wandb"]["id"]
    ids, _ = wandb_series(run_dir, learner_id)
    res = offpolicy_run(run_overrides, "--resume", LOGGERS, "run.wandb.mode=offline", "learner.total_steps=10", *EVAL)
    assert res.returncode == 0, res.stdout + res.stderr
    check_run_invariants(run_dir, 1)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "failed" not in log, log
    assert "failed" not in (run_dir / "logs" / "eval.log").read_text()
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [r["version"] for r in evals] == [0, 3, 6, 9, 10]

    def check_eval(name: str, got: dict[str, list[tuple[int, float]]]) -> None:
        for key, want in (("eval/pass_at_1", [(r["version"], r["pass_at_k"]["1"]) for r in evals]),
                          ("eval/reward_mean", [(r["version"], r["reward_mean"]) for r in evals])):
            assert [s for s, _ in got[key]] == [s for s, _ in want], f"{name} {key}: steps differ"
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in want], rel=1e-5), f"{name} {key}"

    # wandb: two offline folders (one per learner start) of one run id; steps 0..9 once each, in order;
    # the eval daemon's run (its own W&B run in the group) has pass@1 at each evaluated version
    ids2, hist = wandb_series(run_dir, learner_id)
    assert ids2 == ids == {learner_id}
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{learner_id}"))) == 2
    check_series("wandb", {k: [(h["_step"], h[k]) for h in hist] for k in SERIES}, rows)
    config = run_info(next((run_dir / "wandb").glob(f"offline-run-*-{learner_id}/run-*.wandb")))["config"]
    assert config["algo"]["max_staleness"] == 1 and config["run"]["name"] == "quickstart"
    eval_ids, eval_hist = wandb_series(run_dir, eval_id)
    assert eval_ids == {eval_id} != ids
    check_eval("wandb", {k: [(h["_step"], h[k]) for h in eval_hist] for k in ("eval/pass_at_1", "eval/reward_mean")})

    # TensorBoard: the learner's and the eval daemon's event files read as one run, every series forward only
    tb = tensorboard_series(run_dir)
    check_series("tensorboard", tb, rows)
    check_eval("tensorboard", tb)

    # MLflow: one run in the local store, the config as parameters, finished; eval results in the same run
    runs, series = mlflow_series(run_dir)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["algo.max_staleness"] == "1"
    check_series("mlflow", series, rows)
    check_eval("mlflow", series)

    # console: a line per step in the learner's log
    assert "step 9  reward_mean" in log


@pytest.mark.slow  # a run of its own (~20 s); test_loggers checks a failing tracker is left out
def test_unreachable_trackers_warn_once_and_training_goes_on(run_overrides, tmp_path):
    """wandb online and MLflow at a port nobody listens on, TensorBoard under a file: the run finishes."""
    (dead,) = free_ports(1)
    (tmp_path / "a-file").write_text("not a directory")
    env = {**os.environ, "WANDB_BASE_URL": f"http://127.0.0.1:{dead}", "WANDB_API_KEY": "x" * 40,
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    res = offpolicy_run(run_overrides, LOGGERS, "run.wandb.mode=online", "run.wandb.init_timeout_s=5",
                        f"run.mlflow.tracking_uri=http://127.0.0.1:{dead}",
                        f"run.tensorboard.dir={tmp_path / 'a-file' / 'tb'}", "learner.total_steps=8", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == 8
    log = (run_dir / "logs" / "learner.log").read_text()
    for tracker in ("wandb", "tensorboard", "mlflow"):
        assert log.count(f"tracker {tracker} failed") == 1, log
    assert "step 7  reward_mean" in log  # console goes on
