"""The supervisor never waits on a kill (offpolicy/launch/supervisor.py): a dead process whose group lingers (a child
that ignores SIGTERM, as a wedged EngineCore can) is buried in the background, its restart waits for the burial,
and the death of another process meanwhile is seen at once. Real processes and process groups."""

from __future__ import annotations

import time

from offpolicy.config import SuperviseConfig
from offpolicy.launch.supervisor import Supervisor
from tests.polling import poll

# the leader exits at once; its child (same group) ignores SIGTERM and lives until SIGKILL
LINGERING = ["bash", "-c", "(trap '' TERM; sleep 60) & sleep 0.3; exit 3"]
QUICK_DEATH = ["bash", "-c", "sleep 0.5; exit 4"]
GRACE = 5.0


def test_a_lingering_group_is_buried_in_the_background_and_restarted_after(tmp_path):
    sup = Supervisor(SuperviseConfig(kill_grace_s=GRACE), tmp_path)
    try:
        slow = sup.add("vllm-0", LINGERING, None)
        other = sup.add("rollout-0", QUICK_DEATH, None)
        dead = poll(lambda: [p for p in sup.deaths() if p.name == "vllm-0"], 10)
        t0 = time.monotonic()
        sup.schedule(dead[0].unit, 0.0)
        assert time.monotonic() - t0 < 0.5  # the kill of its group runs in the background
        assert sup.due() == []  # not restarted while its old group still lives (the SIGTERM-proof child)
        slow.cmd = ["sleep", "60"]  # what comes back leaves on SIGTERM (the end of the test need not wait)
        seen = poll(lambda: [p.name for p in sup.deaths()], GRACE)  # the loop goes on: the other death is seen
        assert seen == ["rollout-0"] and sup.burying(slow)  # ... while the first group's burial still runs
        started = poll(sup.due, 2 * GRACE)  # once the child got its SIGKILL after kill_grace_s
        assert [p.name for p in started] == ["vllm-0"] and time.monotonic() - t0 >= GRACE
        assert slow.restarts == 1 and slow.running() and other.popen.returncode == 4
        assert (tmp_path / "vllm-0.log").read_text().count("restart 1 of vllm-0") == 1
    finally:
        sup.stop([["vllm-0", "rollout-0"]], timeout=5)
    assert not slow.running()


# the leader takes 1 s to leave after SIGTERM; a child of its group ignores SIGTERM and lives until SIGKILL
SLOW_LEAVER = ["bash", "-c", "(trap '' TERM; sleep 60) & trap 'sleep 1; exit 0' TERM; while :; do sleep 0.05; done"]


def test_stop_signals_every_process_and_every_group_at_once_and_says_what_it_took(tmp_path):
    grace = 1.5
    sup = Supervisor(SuperviseConfig(kill_grace_s=grace), tmp_path)
    procs = [sup.add(f"rollout-{i}", SLOW_LEAVER, None) for i in range(3)]
    time.sleep(0.3)  # their traps are set
    report = sup.stop([[p.name for p in procs]], timeout=30)
    assert not any(p.running() for p in procs)
    assert set(report.exits) == {"rollout-0", "rollout-1", "rollout-2"} and not report.killed
    assert all(0.9 <= s for s in report.exits.values())  # each left on its own, a second after its SIGTERM
    # the three lingering groups are SIGKILLed together after one kill_grace_s (in turn: three)
    assert report.groups_killed == ["rollout-0", "rollout-1", "rollout-2"]
    assert grace <= report.groups_s < 2 * grace, report.line()
    assert "SIGKILL to what rollout-0, rollout-1, rollout-2 left in its process group" in report.line()


# a vLLM server starting up: the leader answers no SIGTERM, nor does its engine process (same group)
DEAF_SERVER = ["bash", "-c", "trap '' TERM; (trap '' TERM; sleep 60) & while :; do sleep 0.05; done"]


def test_stop_takes_a_servers_whole_group_after_one_grace_not_the_stops_timeout(tmp_path):
    grace = 1.0
    sup = Supervisor(SuperviseConfig(kill_grace_s=grace), tmp_path)
    server = sup.add("vllm-0", DEAF_SERVER, None)
    rollout = sup.add("rollout-0", SLOW_LEAVER, None)
    time.sleep(0.3)  # their traps are set
    report = sup.stop([["vllm-0", "rollout-0"]], timeout=30, quick=frozenset({"vllm-0"}))
    assert not server.running() and not rollout.running()
    assert report.whole_killed == ["vllm-0"] and not report.killed  # the server: SIGKILL after one grace
    assert grace <= report.exits["vllm-0"] < grace + 1.5, report.line()  # not the stop's 30 s
    assert report.seconds < 2 * grace + 2, report.line()  # the rollout's lingering child: one grace more
    assert "SIGKILL to vllm-0 with its process group (past run.supervise.kill_grace_s)" in report.line()
