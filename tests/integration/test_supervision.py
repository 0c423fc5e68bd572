"""`offpolicy run` supervises what it starts (issue 33), against real daemons: SIGKILLed rollout daemons and
learners come back (twice each) and the run finishes with every prompt trained once; a spent budget stops
the run cleanly with the reason; a SIGKILLed launcher leaves nothing behind; a rollout daemon leaves within
5 s of SIGTERM whatever it is doing. The vLLM server cases are in test_vllm_daemons.py (slow)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from offpolicy.config import SuperviseConfig
from tests.conftest import QUICKSTART, daemon_cmd, free_ports
from tests.integration.helpers import check_run_invariants, cmdline, read_jsonl, scrape, stop_all, wait_for
from tests.integration.test_operator import Launcher, steps_logged
from tests.sglang_fake import FakeSGLang, toy_sampler

# one rollout daemon: while it (or the learner) is down, no step is made, so the kills below happen at the
# steps they wait for however fast or slow the machine is, and the run cannot finish before them
FAST = ["run.rollouts=1", "checkpoint.every_steps=4", "transport.lease_timeout_s=5",
        "transport.heartbeat_interval_s=0.5", "transport.heartbeat_timeout_s=3", "run.supervise.backoff_s=0.5"]


def pid_of(run: Launcher, marker: str, name: str) -> psutil.Process:
    """Daemon `name`'s process: after a restart the one the console named (a warm spare that became the daemon keeps
    the spare's command line), before any the launcher's child whose command line holds `marker`."""
    restarted = re.findall(rf"{name} restarted \(pid (\d+)", run.stderr())
    if restarted:
        return psutil.Process(int(restarted[-1]))
    return wait_for(lambda: run.daemon(marker), 60, f"the daemon {marker}")


@pytest.mark.slow  # the default suite's chaos drill (test_chaos.py) kills and brings back both kinds more often
def test_sigkilled_rollout_and_learner_come_back_twice_each_and_the_run_finishes(run_overrides, tmp_path):
    run_dir = run_overrides.run_dir / "quickstart"
    run = Launcher(run_overrides, *FAST, "learner.total_steps=40", tmp=tmp_path)
    try:
        for n in (1, 2):  # the rollout daemon, twice in a row
            wait_for(lambda: steps_logged(run_dir) >= 3 * n, 180, f"step {3 * n}")
            pid_of(run, "--index 0", "rollout-0").kill()
            wait_for(lambda: run.stderr().count("rollout-0 restarted") == n, 60, f"rollout-0's restart {n}")
        for n in (1, 2):  # the learner, twice in a row, each time past a checkpoint
            done = steps_logged(run_dir)
            wait_for(lambda: steps_logged(run_dir) >= done + 5, 180, f"5 more steps after {done}")
            pid_of(run, "offpolicy.services.learner", "learner").kill()
            wait_for(lambda: run.stderr().count("learner restarted") == n, 60, f"the learner's restart {n}")
            log = run_dir / "logs" / "learner.log"
            wait_for(lambda: log.read_text().count("resuming at step") == n, 120, f"resume {n}")
        code = run.proc.wait(300)
    finally:
        run.stop()
    err = run.stderr()
    assert code == 0, err
    assert len(re.findall(r"rollout-0 \(pid \d+\) was killed by SIGKILL after \d+ s; restarting it in", err)) == 2, err
    assert len(re.findall(r"learner \(pid \d+\) was killed by SIGKILL after \d+ s; restarting every learner rank, "
                          r"from the newest checkpoint", err)) == 2, err
    assert "restart 2 of run.supervise.max_restarts=3" in err
    summary = check_run_invariants(run_dir, 1)  # 0 prompts lost or duplicated, versions contiguous
    assert summary["steps"] == 40
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(40))


def test_a_spent_budget_stops_the_run_cleanly_with_the_reason(run_overrides, tmp_path):
    run_dir = run_overrides.run_dir / "quickstart"
    run = Launcher(run_overrides, *FAST, "learner.total_steps=100000", "run.supervise.max_restarts=0", tmp=tmp_path)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 2, 180, "the first steps")
        pid_of(run, "--index 0", "rollout-0").kill()
        code = run.proc.wait(120)
    finally:
        run.stop()
    err = run.stderr()
    assert code == 1, err
    assert re.search(r"rollout-0 \(pid \d+\) was killed by SIGKILL after \d+ s; its restart budget is spent: 0 "
                     r"restart\(s\) within run.supervise.restart_window_s=3600 s, run.supervise.max_restarts=0: "
                     r"stopping the run", err), err
    assert "Traceback" not in err
    summary = check_run_invariants(run_dir, 1)  # the learner stopped on SIGTERM: summary.json, nothing lost
    assert summary["steps"] >= 2
    assert "summary:" in run.out.read_text()


def run_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """Every process of a run: the launcher's descendants (daemons, the reaper) and each one's group."""
    kids = psutil.Process(launcher.pid).children(recursive=True)
    groups = {os.getpgid(k.pid) for k in kids if k.is_running()}
    return kids + [p for p in psutil.process_iter() if p.pid not in {k.pid for k in kids}
                   and p.is_running() and _pgid(p.pid) in groups]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_a_sigkilled_launcher_leaves_no_process_of_the_run(run_overrides, tmp_path):
    run_dir = run_overrides.run_dir / "quickstart"
    run = Launcher(run_overrides, "learner.total_steps=100000", tmp=tmp_path)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 2, 180, "the first steps")
        procs = run_processes(run.proc)
        # read before the kill: a daemon dies at once of its parent-death signal, and a zombie has no command line
        names = {p.pid: cmdline(p) for p in procs}
        seen = " ".join(names.values())
        assert all(m in seen for m in ("services.learner", "--index 0", "--index 1", "launch.reaper")), seen
        run.proc.kill()
        run.proc.wait()
        t0, names = time.monotonic(), {pid: name[:100] for pid, name in names.items()}
        left = {p.pid for p in procs}
        while left and time.monotonic() - t0 < 5:
            for pid in list(left):
                if not alive(pid):
                    left.discard(pid)
                    print(f"{time.monotonic() - t0:5.2f} s after the launcher's SIGKILL: gone {names[pid]}")
            time.sleep(0.05)
        assert not left, [names[pid] for pid in left]
    finally:
        for p in psutil.Process(os.getpid()).children(recursive=True):
            p.kill()


def test_a_sigtermed_launcher_stops_every_daemon_at_once_within_the_kill_grace(run_overrides, tmp_path):
    """Ctrl-C or SIGTERM to `offpolicy run`: every daemon gets SIGTERM at once and leaves on its own (no SIGKILL,
    no rollout's exit deadline), the learner with its checkpoint and summary; the launcher's own account of the
    stop ("stopped in X s (after SIGTERM: ...)") stays within run.supervise.kill_grace_s."""
    run_dir = run_overrides.run_dir / "quickstart"
    grace = SuperviseConfig().kill_grace_s
    run = Launcher(run_overrides, "learner.total_steps=100000", tmp=tmp_path)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 3, 180, "the first steps")
        run.proc.send_signal(signal.SIGTERM)
        code = run.proc.wait(120)
    finally:
        run.stop()
    err = run.stderr()
    assert code == 130, err
    m = re.search(r"stopped in ([\d.]+) s \(after SIGTERM: (.*?); their process groups ([\d.]+) s\)(.*)", err)
    assert m, err
    print(m.group(0))
    exits = {name: float(s) for name, s in re.findall(r"([\w-]+) ([\d.]+) s", m.group(2))}
    assert set(exits) == {"learner", "rollout-0", "rollout-1"}, m.group(0)
    assert "SIGKILL" not in m.group(4), m.group(0)
    for name in ("rollout-0", "rollout-1"):  # each left on its own, not at its exit deadline
        assert "did not finish stopping" not in (run_dir / "logs" / f"{name}.log").read_text()
    assert float(m.group(1)) <= grace, f"{m.group(0)}: past run.supervise.kill_grace_s={grace}"
    summary = check_run_invariants(run_dir, 1)  # the learner's SIGTERM: checkpoint, summary.json, nothing lost
    assert (run_dir / "checkpoints" / f"step-{summary['steps']:06d}").is_dir()


def test_a_process_group_dies_with_the_supervisor_even_when_it_is_sigkilled(tmp_path):
    """A grandchild in a daemon's group (as vLLM's EngineCore is in its server's) is not the launcher's child:
    the reaper ends it when the launcher dies, and the group goes before a restart."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from offpolicy.config import SuperviseConfig\n"
        "from offpolicy.launch.supervisor import Supervisor\n"
        "sup = Supervisor(SuperviseConfig(), Path(sys.argv[1]))\n"
        "p = sup.add('server', ['sh', '-c', 'sleep 1000 & sleep 1000 & wait'], None)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(1000)\n")
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    leader = int(parent.stdout.readline())
    group = wait_for(lambda: [p for p in psutil.process_iter(["name"]) if _pgid(p.pid) == leader
                              and p.info["name"] == "sleep"] or None, 10, "the group's two sleeps")
    parent.kill()
    parent.wait()
    _, alive = psutil.wait_procs([psutil.Process(leader), *group], timeout=5)
    assert not alive


@pytest.fixture
def rollout_log(tmp_path):
    return tmp_path / "rollout.log"


def start_rollout(overrides, log, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(daemon_cmd("rollout", "--config", QUICKSTART, *overrides, "--index", "0", *extra),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def sigterm_exit_seconds(proc: subprocess.Popen, log) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 5 s after SIGTERM; its log ends:\n{log.read_text()[-3000:]}") from None
    return time.monotonic() - t0


@pytest.mark.parametrize("state", ["waiting for its learner", "waiting for a server", "mid-load", "mid-generate"])
def test_a_rollout_daemon_leaves_within_5_s_of_sigterm(run_overrides, rollout_log, tmp_path, state):
    block, entered = threading.Event(), threading.Event()

    def hold(*_):
        entered.set()
        block.wait(600)
        return [([1], [0.0], "length")]

    fake = FakeSGLang(on_update=hold if state == "mid-load" else None,
                      sampler=hold if state == "mid-generate" else toy_sampler)
    sglang = ["rollout.engine=sglang", "rollout.sglang.mode=http", f"rollout.sglang.urls=[{fake.url}]",
              "rollout.sglang.startup_timeout_s=600"]
    procs = []
    try:
        if state == "waiting for its learner":
            port, = free_ports(1)
            procs.append(start_rollout(run_overrides, rollout_log, f"metrics.port={port}"))
            wait_for(lambda: scrape(port), 60, "the rollout's metrics (it serves them before it joins)")
        elif state == "waiting for a server":
            fake.stop()
            procs.append(start_rollout(run_overrides, rollout_log, *sglang))
            wait_for(lambda: "waiting up to rollout.sglang.startup_timeout_s" in rollout_log.read_text(), 60,
                     "the wait for the server")
        else:
            learner_log = open(tmp_path / "learner.log", "w")
            procs.append(subprocess.Popen(daemon_cmd("learner", "--config", QUICKSTART, *run_overrides, *sglang),
                                          stdout=learner_log, stderr=subprocess.STDOUT))
            procs.append(start_rollout(run_overrides, rollout_log, *sglang))
            assert entered.wait(120), f"the rollout never got {state}:\n{rollout_log.read_text()[-3000:]}"
        seconds = sigterm_exit_seconds(procs[-1], rollout_log)
        print(f"rollout daemon {state}: gone {seconds:.2f} s after SIGTERM (exit code {procs[-1].returncode})")
        assert procs[-1].returncode in (0, -signal.SIGTERM), rollout_log.read_text()[-3000:]
        assert "Traceback" not in rollout_log.read_text()
    finally:
        block.set()
        stop_all(procs)
        if state != "waiting for a server":
            fake.stop()
