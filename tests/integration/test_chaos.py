"""Chaos: kill and restart rollouts and the learner on a schedule during one epoch of training.

At the end every prompt of the epoch was trained exactly once, the versions are contiguous, and the
staleness bound held throughout; the kills survived are printed (run pytest with -s to see them).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from tests.conftest import QUICKSTART, daemon_cmd
from tests.integration.helpers import (check_run_invariants, descendants_until_exit, read_jsonl, still_alive, stop_all,
                                       wait_for)

STEPS, BATCH = 30, 16
EPOCH = STEPS * BATCH // 2  # two epochs: stragglers of the first are requeued first and finish in the second
CHAOS = [f"learner.total_steps={STEPS}", f"data.synthetic.num_prompts={EPOCH}", "checkpoint.every_steps=4",
         "transport.lease_timeout_s=5", "transport.heartbeat_interval_s=0.5", "transport.heartbeat_timeout_s=3"]


class Cluster:
    def __init__(self, overrides, tmp_path):
        self.overrides, self.tmp_path = [*overrides, *CHAOS], tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts = 0
        self.metrics = overrides.run_dir / "quickstart" / "metrics.jsonl"

    def start(self, name: str, *extra: str) -> None:
        module = "learner" if name == "learner" else "rollout"
        self.starts += 1
        log = open(self.tmp_path / f"{name}-{self.starts}.log", "w")
        self.procs[name] = subprocess.Popen(daemon_cmd(module, "--config", QUICKSTART, *self.overrides, *extra),
                                            stdout=log, stderr=subprocess.STDOUT)

    def steps_done(self) -> int:
        return len(read_jsonl(self.metrics)) if self.metrics.exists() else 0

    def wait_steps(self, n: int, timeout: float = 120) -> None:
        wait_for(lambda: self.steps_done() >= n, timeout, f"{n} steps")


def test_kills_and_restarts_lose_nothing_and_train_nothing_twice(run_overrides, tmp_path):
    c = Cluster(run_overrides, tmp_path)
    kills = []
    try:
        c.start("learner")
        c.start("r0", "--index", "0")
        c.start("r1", "--index", "1")
        c.wait_steps(5)
        c.procs["r0"].send_signal(signal.SIGKILL)                   # a rollout server dies ...
        kills.append("rollout SIGKILL")
        time.sleep(1)
        c.start("r0", "--index", "0")                               # ... and comes back
        c.wait_steps(11)
        c.procs["learner"].send_signal(signal.SIGKILL)              # the learner dies mid-run
        c.procs["learner"].wait(10)
        kills.append("learner SIGKILL")
        c.start("learner", "--resume")                              # rollouts stay up and rejoin
        # metrics.jsonl still holds the killed learner's steps until the new one cuts it back: wait for
        # the resume itself, then for steps the new learner trained
        log = tmp_path / f"learner-{c.starts}.log"
        resumed = wait_for(lambda: re.search(r"resuming at step (\d+)", log.read_text()), 120, "the resume")
        c.wait_steps(max(18, int(resumed.group(1)) + 3))
        c.procs["learner"].send_signal(signal.SIGTERM)              # preemption: drain + final checkpoint
        assert c.procs["learner"].wait(60) == 0
        kills.append("learner SIGTERM")
        for r in ("r0", "r1"):                                      # its Goodbye ends the rollouts
            assert c.procs[r].wait(60) == 0
        stopped_at = c.steps_done()
        ckpts = sorted((run_overrides.run_dir / "quickstart" / "checkpoints").iterdir())
        assert ckpts[-1].name == f"step-{stopped_at:06d}"         # SIGTERM wrote a final checkpoint ...
        c.start("learner", "--resume")
        log = tmp_path / f"learner-{c.starts}.log"
        c.start("r0", "--index", "0")
        c.start("r1", "--index", "1")
        wait_for(lambda: f"resuming at step {stopped_at}" in log.read_text(), 120,  # ... and the resume goes on
                 f"the resume at step {stopped_at}")                                # from it
        c.wait_steps(24)
        c.procs["r1"].send_signal(signal.SIGKILL)
        kills.append("rollout SIGKILL")
        c.start("r1", "--index", "1")
        assert c.procs["learner"].wait(240) == 0
    finally:
        stop_all(list(c.procs.values()))
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, 1)
    trained = read_jsonl(run_dir / "trained.jsonl")
    assert sorted(t["prompt_id"] for t in trained if t["epoch"] == 0) == list(range(EPOCH))  # all, once each
    assert summary["steps"] == STEPS
    print(f"chaos: survived {len(kills)} kills ({', '.join(kills)}); {len(trained)} groups trained exactly once, "
          f"steps 0..{STEPS - 1} contiguous, leases expired in the last learner process {summary['leases_expired']}")


# slow: the default suite has this in test_kills_and_restarts_lose_nothing_and_train_nothing_twice (a SIGTERMed
# learner's final checkpoint at the step it stopped, the resume from it, the rollouts ended and started again, the
# whole run one epoch with contiguous versions)
@pytest.mark.slow
@pytest.mark.parametrize("every", [3])
def test_resume_continues_with_the_same_next_version_and_prompts(run_overrides, tmp_path, every):
    """SIGTERM after a few steps, resume: the next version is the checkpoint's + 1, the first prompts
    handed out are the ones that were in flight, and the final run is exactly one epoch."""
    c = Cluster(run_overrides, tmp_path)
    try:
        c.start("learner", f"checkpoint.every_steps={every}")
        c.start("r0", "--index", "0")
        c.wait_steps(7)
        c.procs["learner"].send_signal(signal.SIGTERM)
        assert c.procs["learner"].wait(60) == 0
        assert c.procs["r0"].wait(60) == 0
        stopped_at = c.steps_done()
        ckpts = sorted((run_overrides.run_dir / "quickstart" / "checkpoints").iterdir())
        assert ckpts[-1].name == f"step-{stopped_at:06d}"  # SIGTERM wrote a final checkpoint
        c.start("learner", "--resume")
        c.start("r0", "--index", "0")
        assert c.procs["learner"].wait(240) == 0
    finally:
        stop_all(list(c.procs.values()))
    run_dir = run_overrides.run_dir / "quickstart"
    check_run_invariants(run_dir, 1)
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(STEPS))
    log = "".join(p.read_text() for p in tmp_path.glob("learner-*.log"))
    assert f"resuming at step {stopped_at}" in log


def test_a_seeded_chaos_drill_of_the_launcher_loses_nothing_and_leaves_nothing(run_overrides, tmp_path, shm_root):
    """`offpolicy run ... run.chaos.every_s=4`: the launcher kills the learner and the rollout daemons in turn (the
    learner once it has a checkpoint), about every 4 s (once a step was trained since the last), and supervises them back. The run finishes with every prompt
    trained once and the staleness bound held; a rollout's kill never stalls the run for the heartbeat timeout (its
    restart takes its leases back at once); nothing of the run is left running or in shared memory."""
    import json

    from tests.integration.test_operator import Launcher

    run_dir = run_overrides.run_dir / "quickstart"
    run = Launcher(run_overrides, "learner.total_steps=100", "checkpoint.every_steps=10", "run.chaos.every_s=4",
                   "run.chaos.seed=1", "run.chaos.targets=[learner,rollout]", "run.chaos.max_kills=4",
                   "run.supervise.max_restarts=20",
                   "transport.heartbeat_timeout_s=60", tmp=tmp_path)
    try:
        deadline = time.monotonic() + 400
        kids = descendants_until_exit(run.proc, deadline)  # every process it started, to check later
        code = run.proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        run.stop()
    err = run.stderr()
    assert code == 0, err[-3000:]
    summary = check_run_invariants(run_dir, 1)  # 0 lost, 0 duplicated, staleness <= 1, versions contiguous
    chaos = json.loads((run_dir / "chaos.json").read_text())
    assert summary["steps"] == 100 and summary["chaos_kills"] == chaos["kills"] == 4, err[-3000:]
    assert {"learner", "rollout"} <= set(chaos["kills_by_kind"]), chaos
    assert len(re.findall(r"chaos: SIGKILL to \S+ \(pid \d+\)", err)) == chaos["kills"]
    assert chaos["stall_max_s"]["rollout"] < 60, chaos  # not the heartbeat timeout: its restart freed its leases
    # spares are up from the first step on: each restart took one over, or found the first, niced, still warming up
    # (at run.supervise.spare_nice it takes only the CPU the run leaves, which a busy machine may not leave)
    restarts = re.findall(r"(\S+) restarted \(pid \d+(, from a warm spare)?; restart \d+ in this run(; cold: the "
                          r"spare was still warming up)?", err)
    assert restarts and all(warm or warming for _, warm, warming in restarts), restarts
    assert not still_alive(kids)
    from pathlib import Path

    left = list(Path(shm_root).glob("*")) if Path(shm_root).exists() else []
    assert not left, left  # the weight store went with the run
