"""Warm spares (offpolicy/launch/spare.py) through the supervisor, with real processes: the first spare warms up at
run.supervise.spare_nice (its session's autogroup where the kernel has them, and its importing thread) while its main
thread, the daemon-to-be, keeps the launcher's niceness; once it said `ready` a restart takes it over, gives its
session its niceness back and runs the daemon (here `offpolicy-rollout --help`, which prints its usage into the log);
a restart that comes while it still warms up starts cold; either way the spare that follows, in a run that lost a
process, warms up at the run's priority and is taken even mid-import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from offpolicy.config import SuperviseConfig
from offpolicy.launch.supervisor import Supervisor
from tests.polling import poll

DAEMON = [sys.executable, "-m", "offpolicy.services.rollout", "--help"]  # warmable; prints its usage, exits 0
NICE = 1  # told apart from 0, and low enough for a busy test machine to warm the spare up in time


def nices(pid: int) -> dict[int, int]:
    """Each thread of `pid` -> its niceness (/proc/<pid>/task/<tid>/stat's 19th field)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def autogroup_nice(pid: int) -> int | None:
    path = Path(f"/proc/{pid}/autogroup")
    return int(path.read_text().split()[-1]) if path.exists() else None


def test_a_session_gets_its_autogroup_niceness_back_without_privilege():
    """What a spare relies on: raising its session's autogroup niceness and lowering it back to 0, in a session of
    its own (run as whatever user the suite runs as; lowering the niceness of a process instead needs privilege)."""
    code = ("from offpolicy.launch.spare import group_nice; before = group_nice(); "
            "print(before, group_nice(11), group_nice(before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, start_new_session=True,
                         check=True).stdout.split()
    if out[0] == "None":
        return  # a kernel without autogroups: the importing thread's own niceness is what counts there
    assert out == ["0", "11", "0"], out


def test_a_niced_spare_becomes_the_daemon_once_ready_and_its_replacement_warms_up_at_the_runs_priority(tmp_path):
    sup = Supervisor(SuperviseConfig(spare_nice=NICE, kill_grace_s=1.0), tmp_path)
    try:
        proc = sup.add("rollout-0", DAEMON, None)
        poll(lambda: proc.popen.poll() is not None, 120)
        sup.keep_spares()
        (spare,) = sup.spares.values()
        threads = poll(lambda: (t := nices(spare.pid)) and NICE in t.values() and t, 60)
        assert threads[spare.pid] == 0  # the main thread, the daemon-to-be, is not niced: only the imports are
        assert autogroup_nice(spare.pid) in (None, NICE)  # its session, where the kernel schedules by session

        poll(lambda: sup.spare_ready(spare), 300)  # its imports are done, and it says so
        assert nices(spare.pid)[spare.pid] == 0
        sup.schedule("rollout-0", 0.0)
        poll(sup.due, 30)
        assert proc.warm and not proc.spare_warming and proc.pid == spare.pid and not sup.spares
        assert proc.popen.wait(60) == 0

        sup.keep_spares()  # the run lost a process: the spare that replaces the one taken warms up at its priority
        (again,) = sup.spares.values()
        assert sup.nice[again.pid] == 0 and autogroup_nice(again.pid) in (None, 0)
        sup.schedule("rollout-0", 0.0)  # taken even before it is ready: at the run's priority it is never starved
        poll(sup.due, 30)
        assert proc.warm and proc.pid == again.pid
        assert proc.popen.wait(120) == 0
    finally:
        sup.stop([["rollout-0"]], timeout=5)
    log = (tmp_path / "rollout-0.log").read_text()
    assert log.count("usage: offpolicy-rollout") == 3, log  # the cold start, then each spare's
    assert "restart 2 of rollout-0" in log
    assert "could not set its session's CPU share back" not in log


def test_a_restart_passes_a_niced_spare_still_warming_up_and_starts_cold(tmp_path):
    """The first spare takes only the CPU the run leaves: a restart that comes before it is ready does not wait for
    it, starts cold, and the spare makes way for one at the run's priority (a run that lost a process)."""
    sup = Supervisor(SuperviseConfig(spare_nice=19, kill_grace_s=1.0), tmp_path)
    try:
        proc = sup.add("rollout-0", DAEMON, None)
        poll(lambda: proc.popen.poll() is not None, 120)
        sup.keep_spares()
        (spare,) = sup.spares.values()
        sup.schedule("rollout-0", 0.0)  # at once: its imports take seconds
        poll(sup.due, 30)
        assert not proc.warm and proc.spare_warming and proc.pid != spare.pid
        assert spare.poll() is not None and not sup.spares  # it made way
        sup.keep_spares()
        (again,) = sup.spares.values()
        assert sup.nice[again.pid] == 0
        assert proc.popen.wait(60) == 0
    finally:
        sup.stop([["rollout-0"]], timeout=5)


def test_spares_that_exit_unused_are_not_started_again_and_again(tmp_path, monkeypatch, capsys):
    """A spare that cannot warm up (here: its interpreter exits at once) is replaced SPARES_LOST_MAX - 1 times, then
    no more: the supervision loop never turns into a loop of starting spares."""
    from offpolicy.launch import supervisor

    sup = Supervisor(SuperviseConfig(spare_nice=NICE), tmp_path)
    monkeypatch.setattr(supervisor.sys, "executable", "/bin/false")  # the spares' interpreter: exits 1 at once
    try:
        sup.add("rollout-0", ["/bin/false", "-m", "offpolicy.services.rollout"], None)  # warmable with it
        for _ in range(2 * supervisor.SPARES_LOST_MAX):
            sup.keep_spares()
            for spare in list(sup.spares.values()):
                spare.wait(10)
        sup.keep_spares()
        assert not sup.spares and sup.spares_lost == {(): supervisor.SPARES_LOST_MAX}
    finally:
        monkeypatch.undo()
        sup.stop([["rollout-0"]], timeout=5)
    assert "restarts of rollout-0 and its like start cold from now on" in capsys.readouterr().err
