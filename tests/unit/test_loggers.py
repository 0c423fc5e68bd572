"""offpolicy.loggers: the fan-out thread (a failing tracker is warned about once and left out, a full
queue drops, a resumed run never sends a step twice), the config as MLflow parameters, and that no
entry point's --help imports a tracker or data library."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from offpolicy.loggers import trackers as loggers
from offpolicy.loggers.mlflow_run import flatten
from offpolicy.loggers.state import TrackerState
from offpolicy.loggers.trackers import Trackers, scalars


class Recorder:
    def __init__(self, fail_on: int | None = None, fail_start: bool = False):
        self.steps, self.fail_on, self.fail_start, self.closed = [], fail_on, fail_start, False

    def start(self, state, config, resume):
        if self.fail_start:
            raise ConnectionError("no network")
        state.update_run("rec", id="abc")

    def log(self, step, values):
        if step == self.fail_on:
            raise OSError(28, "No space left on device")
        self.steps.append((step, values))

    def close(self):
        self.closed = True


def test_scalars_keep_numbers_and_drop_the_step_axis():
    assert scalars({"step": 3, "version": 4, "reward_mean": 0.5, "tag": "x", "n": 2}) == \
        {"version": 4.0, "reward_mean": 0.5, "n": 2.0}


def test_a_failing_tracker_warns_once_and_the_others_go_on(tmp_path, caplog):
    good, bad, dead = Recorder(), Recorder(fail_on=2), Recorder(fail_start=True)
    t = Trackers({"good": good, "bad": bad, "dead": dead}, TrackerState(tmp_path / "trackers.json"), {}, False)
    with caplog.at_level(logging.WARNING, "offpolicy.trackers"):
        for s in range(5):
            t.log(s, {"step": s, "loss": float(s)})
        t.close()
    assert [s for s, _ in good.steps] == [0, 1, 2, 3, 4] and good.closed
    assert [s for s, _ in bad.steps] == [0, 1] and not bad.closed
    assert dead.steps == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert any("tracker bad failed to log" in w and "No space left" in w for w in warnings)
    assert any("tracker dead failed to start" in w and "no network" in w for w in warnings)
    state = TrackerState.load(tmp_path / "trackers.json")
    assert state.last_step("good") == 4 and state.last_step("bad") == 1


def test_a_resumed_run_sends_only_steps_after_the_last_one(tmp_path):
    path = tmp_path / "trackers.json"
    first = Recorder()
    t = Trackers({"rec": first}, TrackerState(path), {}, False)
    for s in range(6):  # steps 4, 5 reached the tracker, then the learner died; the checkpoint was step 4
        t.log(s, {"step": s, "x": 1.0})
    t.close()
    again = Recorder()
    t = Trackers({"rec": again}, TrackerState.load(path), {}, True)
    for s in range(4, 9):
        t.log(s, {"step": s, "x": 2.0})
    t.close()
    assert [s for s, _ in again.steps] == [6, 7, 8]
    assert TrackerState.load(path).run("rec") == {"id": "abc"}


def test_a_full_queue_drops_records_and_never_blocks(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loggers, "QUEUE_RECORDS", 3)

    class Slow(Recorder):
        def log(self, step, values):
            time.sleep(0.2)
            super().log(step, values)

    slow = Slow()
    t = Trackers({"slow": slow}, TrackerState(tmp_path / "trackers.json"), {}, False)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, "offpolicy.trackers"):
        for s in range(20):
            t.log(s, {"step": s})
    assert time.perf_counter() - t0 < 0.5
    t0 = time.perf_counter()
    t.close()  # the queued records are sent (a full queue is not a stuck one): ~0.2 s each, not the 60 s timeout
    assert time.perf_counter() - t0 < 30
    assert 3 <= len(slow.steps) < 20 and slow.closed
    assert sum("records behind" in r.getMessage() for r in caplog.records) == 1


def test_a_torn_state_file_starts_fresh(tmp_path):
    (tmp_path / "trackers.json").write_text('{"runs": {"wandb": {"id": "ab')
    assert TrackerState.load(tmp_path / "trackers.json").last_step("wandb") == -1


def test_flatten_gives_dotted_string_parameters():
    assert flatten({"algo": {"max_staleness": 1, "betas": [0.9, 0.99]}, "model": {"arch": {}}}) == \
        {"algo.max_staleness": "1", "algo.betas": "[0.9, 0.99]", "model.arch": "{}"}


@pytest.mark.parametrize("module", ["cli", "learner", "rollout", "relay", "eval_daemon"])
def test_help_is_instant_and_imports_no_tracker_or_data_library(module):
    code = ("import runpy, sys\n"
            f"sys.argv = ['offpolicy-{module}', '--help']\n"
            "try:\n"
            f"    runpy.run_module('offpolicy.services.{module}', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'pyarrow', 'reasoning_gym', 'torch') "
            "if m in sys.modules))\n")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert seconds < 2.0


def test_the_run_log_imports_no_tracker_library():
    code = ("import sys, offpolicy.loggers.runlog, offpolicy.learner.loop\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_stuck_tracker_holds_up_no_other(tmp_path, caplog):
    import threading

    release = threading.Event()

    class Stuck(Recorder):
        def start(self, state, config, resume):
            release.wait(10)  # a tracker whose server does not answer

    good, stuck = Recorder(), Stuck()
    t = Trackers({"stuck": stuck, "good": good}, TrackerState(tmp_path / "trackers.json"), {}, False)
    for s in range(3):
        t.log(s, {"step": s})
    with caplog.at_level(logging.WARNING, "offpolicy.trackers"):
        t.close(timeout_s=1.0)
    release.set()
    assert [s for s, _ in good.steps] == [0, 1, 2] and good.closed
    assert "trackers stuck did not finish within 1 s" in caplog.text


def test_eval_results_become_scalars_at_their_version():
    from offpolicy.loggers.trackers import eval_scalars

    rec = {"version": 6, "pass_at_k": {"1": 0.25, "16": 0.75}, "reward_mean": 0.5, "response_tokens_mean": 4.0,
           "seconds": 1.5, "samples_per_s": 100.0, "prompts": 8, "report": "eval/v6/report.json"}
    assert eval_scalars(rec) == {"eval/pass_at_1": 0.25, "eval/pass_at_16": 0.75, "eval/reward_mean": 0.5,
                                 "eval/response_tokens_mean": 4.0, "eval/seconds": 1.5, "eval/samples_per_s": 100.0}
    assert eval_scalars({"version": 3, "skipped": "behind"}) == {}
