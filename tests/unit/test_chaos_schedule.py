"""The chaos drill's schedule and report (offpolicy/launch/chaos.py) against real processes it kills."""

from __future__ import annotations

import json
import subprocess

import pytest

from offpolicy.config import ChaosConfig
from offpolicy.launch.chaos import Chaos, kind


class Running:
    def __init__(self):
        self.popen = subprocess.Popen(["sleep", "60"])

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None


@pytest.fixture
def procs():
    made = {name: Running() for name in ("learner", "learner-r1", "rollout-0", "rollout-1", "vllm-0")}
    yield made
    for p in made.values():
        p.popen.kill()
        p.popen.wait()


def test_kinds_take_turns_the_learner_only_when_resumable_and_each_kill_is_recorded(tmp_path, procs):
    chaos = Chaos(ChaosConfig(every_s=10, seed=3, targets=["learner", "rollout"], after_steps=2), tmp_path, 0.0)
    assert chaos.tick(100.0, procs, steps=1, resumable=lambda: True) is None  # before after_steps
    kills, t = [], 100.0
    for steps in (2, 3, 4, 5):
        kills.append(chaos.tick(t, procs, steps, resumable=lambda: steps >= 4))
        victim = procs[kills[-1]["name"]]
        assert victim.popen.wait(5) == -9  # SIGKILLed for real
        procs[kills[-1]["name"]] = Running()  # the supervisor brings it back
        t += 15.1  # past the longest gap (1.5 x every_s)
    names = [k["name"] for k in kills]  # one kill each time one is due
    assert [kind(n) for n in names[:2]] == ["rollout", "rollout"]  # the learner's turns skipped: no checkpoint yet
    assert [kind(n) for n in names[2:]] in (["learner", "rollout"], ["rollout", "learner"])  # then the kinds alternate
    assert "learner-r1" not in names  # a learner kill is rank 0's (the others follow it down)
    lines = [json.loads(x) for x in (tmp_path / "chaos.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines] == names and all(x["signal"] == "SIGKILL" for x in lines)


def test_the_same_seed_gives_the_same_drill(tmp_path, procs):
    def drill(seed):
        c = Chaos(ChaosConfig(every_s=10, seed=seed, targets=["rollout", "vllm"], max_kills=2), tmp_path, 0.0)
        return [c.next_at, *(c.tick(1e3 * i, {n: p for n, p in procs.items() if not n.startswith("learner")}, 9 + i,
                                    lambda: False)["name"] for i in (1, 2))]

    first = drill(7)
    for p in procs.values():  # new victims, same names
        p.popen.kill()
        p.popen.wait()
        p.popen = subprocess.Popen(["sleep", "60"])
    assert drill(7) == first and 5 <= first[0] <= 15


def test_no_kill_before_a_step_since_the_last_nor_of_a_process_without_restarts_left(tmp_path, procs):
    chaos = Chaos(ChaosConfig(every_s=1, targets=["rollout"], after_steps=0), tmp_path, 0.0)
    assert chaos.tick(10.0, procs, 5, lambda: True)["steps"] == 5
    assert chaos.tick(20.0, procs, 5, lambda: True) is None  # still at 5 steps: the run has not recovered
    assert chaos.tick(30.0, procs, 6, lambda: True, spare=lambda p: False) is None  # every budget spent
    assert chaos.tick(40.0, procs, 6, lambda: True)["steps"] == 6
    ending = Chaos(ChaosConfig(every_s=1, targets=["rollout"], after_steps=0), tmp_path, 0.0, total_steps=6)
    assert ending.tick(50.0, procs, 6, lambda: True) is None  # every step trained: the run is ending


def test_the_report_counts_each_kills_stall_past_the_usual_step():
    chaos = Chaos(ChaosConfig(every_s=1), __import__("pathlib").Path("/nonexistent"), 0.0)
    chaos.kills = [dict(name="rollout-1", monotonic=10.5, steps=10), dict(name="learner", monotonic=22.5, steps=21)]
    times = [float(i) for i in range(11)] + [13.0 + i for i in range(10)] + [30.0 + i for i in range(5)]
    r = chaos.report(dict(enumerate(times)))
    assert r["usual_step_s"] == 1.0 and r["kills"] == 2
    assert r["each"][0]["stall_s"] == pytest.approx(13.0 - 10.5 - 1.0)  # step 10 was seen before the kill: 11 counts
    assert r["stall_max_s"] == {"rollout": 1.5, "learner": pytest.approx(30.0 - 22.5 - 1.0)}
