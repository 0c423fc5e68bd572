"""A stalled run says so (offpolicy/launch/stall.py): once when it starts, again every stall_timeout_s, with the cause,
in the console line and in offpolicy_launcher_stalled{cause}; the first step after it is said too."""

from __future__ import annotations

from offpolicy.launch.stall import StallWatch, last_warning
from offpolicy.plumbing.metrics import LauncherMetrics


def gauge(m: LauncherMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels)


def test_a_stall_is_reported_with_its_cause_repeated_and_ended():
    m = LauncherMetrics()
    w = StallWatch(10.0, m, now=0.0)
    cause = lambda: ("rollouts_down", "every rollout daemon is down: rollout-0 restarts in 4 s")  # noqa: E731
    assert w.check(9.0, cause) is None and gauge(m, "offpolicy_launcher_seconds_since_step") == 9.0
    line = w.check(10.5, cause)
    assert line.startswith("no training step for 10 s (run.supervise.stall_timeout_s=10): every rollout daemon")
    assert gauge(m, "offpolicy_launcher_stalled", cause="rollouts_down") == 1
    assert gauge(m, "offpolicy_launcher_stalled", cause="learner_down") == 0
    assert w.check(15.0, cause) is None  # said once per stall_timeout_s
    assert w.check(21.0, cause).startswith("no training step for 21 s")
    assert w.step(22.0) == "training goes on again after 22 s without a step"
    assert gauge(m, "offpolicy_launcher_stalled", cause="rollouts_down") == 0
    assert w.step(23.0) is None and w.check(30.0, cause) is None


def test_timeout_zero_never_reports_and_last_warning_reads_the_newest(tmp_path):
    w = StallWatch(0.0, LauncherMetrics(), now=0.0)
    assert w.check(10**6, lambda: ("unknown", "")) is None
    log = tmp_path / "rollout-0.log"
    log.write_text("12:00:01 rollout[0] WARNING offpolicy.vllm: old\n12:00:02 rollout[0] INFO x: fine\n"
                   "12:00:03 rollout[0] WARNING offpolicy.vllm: no vLLM server is up\n12:00:04 rollout[0] INFO y\n")
    assert last_warning(log) == "WARNING offpolicy.vllm: no vLLM server is up"
    assert last_warning(tmp_path / "none.log") is None
