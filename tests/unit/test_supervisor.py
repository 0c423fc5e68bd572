"""The supervisor never waits on a kill (offpolicy/launch/supervisor.py): a dead process whose group lingers (a child
that ignores SIGTERM, as a wedged EngineCore can) is buried in the background, its restart waits for the burial,
and the death of another process meanwhile is seen at once. Real processes and process groups."""

from __future__ import annotations

import time

from offpolicy.config import SuperviseConfig
from offpolicy.launch.supervisor import Supervisor

# the leader exits at once; its child (same group) ignores SIGTERM and lives until SIGKILL
LINGERING = ["bash", "-c", "(trap '' TERM; sleep 60) & sleep 0.3; exit 3"]
QUICK_DEATH = ["bash", "-c", "sleep 0.5; exit 4"]
GRACE = 5.0


def wait_for(cond, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_a_lingering_group_is_buried_in_the_background_and_restarted_after(tmp_path):
    sup = Supervisor(SuperviseConfig(kill_grace_s=GRACE), tmp_path)
    try:
        slow = sup.add("vllm-0", LINGERING, None)
        other = sup.add("rollout-0", QUICK_DEATH, None)
        dead = wait_for(lambda: [p for p in sup.deaths() if p.name == "vllm-0"], 10)
        t0 = time.monotonic()
        sup.schedule(dead[0].unit, 0.0)
        assert time.monotonic() - t0 < 0.5  # the kill of its group runs in the background
        assert sup.due() == []  # not restarted while its old group still lives (the SIGTERM-proof child)
        slow.cmd = ["sleep", "60"]  # what comes back leaves on SIGTERM (the end of the test need not wait)
        seen = wait_for(lambda: [p.name for p in sup.deaths()], GRACE)  # the loop goes on: the other death is seen
        assert seen == ["rollout-0"] and sup.burying(slow)  # ... while the first group's burial still runs
        started = wait_for(sup.due, 2 * GRACE)  # once the child got its SIGKILL after kill_grace_s
        assert [p.name for p in started] == ["vllm-0"] and time.monotonic() - t0 >= GRACE
        assert slow.restarts == 1 and slow.running() and other.popen.returncode == 4
        assert (tmp_path / "vllm-0.log").read_text().count("restart 1 of vllm-0") == 1
    finally:
        sup.stop([["vllm-0", "rollout-0"]], timeout=5)
    assert not slow.running()
