"""The daemons started by hand, as under srun: /metrics, a killed rollout, hostile peers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from offpolicy.wire import protocol
from tests.conftest import QUICKSTART, ROOT, daemon_cmd, free_ports
from tests.integration.helpers import check_run_invariants, scrape, stop_all, wait_for


@pytest.fixture
def start(run_overrides, tmp_path):
    procs: list[subprocess.Popen] = []

    def _start(module: str, *extra: str, name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        p = subprocess.Popen(daemon_cmd(module, "--config", QUICKSTART, *run_overrides, *extra),
                             stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    yield _start
    stop_all(procs)


def test_metrics_endpoints_answer_while_training(start, run_overrides):
    """Both daemons' /metrics while they train; and, their models loaded, neither has imported scikit-learn or scipy."""
    lport, r0port = free_ports(2)
    learner = start("learner", "learner.total_steps=20", f"metrics.port={lport}", name="learner")
    rollout = start("rollout", "--index", "0", f"metrics.port={r0port}", name="rollout0")
    m = wait_for(lambda: (s := scrape(lport)).get("offpolicy_weight_version", 0) >= 5 and s, 120,
                 "the learner to publish version 5")
    for name in ("offpolicy_samples_received_total", "offpolicy_tokens_received_total",
                 "offpolicy_leases_issued_total", "offpolicy_weight_publish_seconds_count",
                 "offpolicy_step_seconds_count", "offpolicy_reward_mean", "offpolicy_loss",
                 "offpolicy_clip_fraction", "offpolicy_approx_kl", "offpolicy_buffered_groups"):
        assert name in m, name
    assert m["offpolicy_samples_received_total"] >= 5 * 16 * 16
    r = wait_for(lambda: (s := scrape(r0port)).get("offpolicy_rollout_weight_version", 0) >= 1 and s, 60,
                 "the rollout to load a new version")
    assert r["offpolicy_weight_load_seconds_count"] >= 1
    assert r["offpolicy_rollout_tokens_total"] > 0
    for daemon in (learner, rollout):  # models loaded: neither mapped scikit-learn or scipy (models/imports.py)
        maps = Path(f"/proc/{daemon.pid}/maps")
        mapped = maps.read_text() if maps.exists() else ""
        assert "/sklearn/" not in mapped and "/scipy/" not in mapped, "a daemon imported scikit-learn or scipy"
    assert learner.wait(120) == 0


def test_a_first_load_longer_than_the_heartbeat_timeout_does_not_silence_the_rollout(start, run_overrides, tmp_path):
    """A rollout joining a run loads the newest version before it generates (42 GB took a vLLM server 24-30 s on
    an H200): it heartbeats meanwhile, so the hub never takes it for dead (`silent for`) however long that load."""
    fast = ["transport.heartbeat_interval_s=0.3", "transport.heartbeat_timeout_s=1.5"]
    learner = start("learner", "learner.total_steps=3", *fast, name="learner")
    with open(tmp_path / "rollout.log", "w") as log:
        rollout = subprocess.Popen([sys.executable, "-m", "tests.slow_first_load", "--config", QUICKSTART,
                                    *run_overrides, *fast], cwd=ROOT, env={**os.environ, "SLOW_LOAD_S": "4"},
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        assert learner.wait(240) == 0
        assert rollout.wait(60) == 0
    finally:
        stop_all([rollout])
    said = (tmp_path / "learner.log").read_text()
    assert "silent for" not in said, said[-3000:]
    assert "loaded weight version 0" in (tmp_path / "rollout.log").read_text()


@pytest.mark.slow  # ~35 s; test_chaos kills and restarts rollouts in the default suite
def test_killed_rollout_loses_only_time(start, run_overrides):
    """SIGKILL one of two rollouts mid-run: its leases expire and go to the other; nothing lost."""
    fast = ["transport.lease_timeout_s=4", "transport.heartbeat_interval_s=0.5", "transport.heartbeat_timeout_s=3"]
    lport, = free_ports(1)
    # enough steps after the kill that the run cannot end before the dead daemon's leases time out
    learner = start("learner", "learner.total_steps=200", f"metrics.port={lport}", *fast, name="learner")
    victim = start("rollout", "--index", "0", *fast, name="rollout0")
    start("rollout", "--index", "1", *fast, name="rollout1")
    wait_for(lambda: scrape(lport).get("offpolicy_weight_version", 0) >= 5, 120, "5 steps")
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: scrape(lport).get("offpolicy_leases_expired_total", 0) >= 1, 60,
             "the killed rollout's leases to expire")
    assert learner.wait(300) == 0
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)
    assert summary["steps"] == 200
    assert summary["leases_expired"] >= 1


def _dealer(port: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 90_000)  # an answer, however late: at load 17-30 on 2 cores the hub took > 10 s
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def test_hostile_messages_are_rejected_and_counted(start, run_overrides):
    lport, = free_ports(1)
    learner = start("learner", "learner.total_steps=5", f"metrics.port={lport}", name="learner")
    wait_for(lambda: scrape(lport).get("offpolicy_weight_version") == 0, 60, "version 0")
    bad = _dealer(run_overrides.work_port)
    bad.send_multipart([b"\xff\x00garbage"])
    assert protocol.decode(bad.recv_multipart())[0].code == "bad_message"
    bad.send_multipart([msgspec.msgpack.encode({"type": "hello", "proto": 99, "daemon_id": "x", "engine": "t",
                                                "max_groups": 1})])
    assert protocol.decode(bad.recv_multipart())[0].code == "protocol_version"
    bad.send_multipart(protocol.encode(protocol.WorkRequest(credits=4)))  # no hello first
    assert protocol.decode(bad.recv_multipart())[0].code == "not_welcome"
    bad.send_multipart(protocol.encode(protocol.Hello(daemon_id="intruder", engine="none", max_groups=1)))
    assert isinstance(protocol.decode(bad.recv_multipart())[0], protocol.Welcome)
    group = protocol.SampleGroup(lease_id=999, prompt_id=0, epoch=0, weight_version=0,
                                 response_lengths=[1] * 16, rewards=[1.0] * 16, finish_reasons=["stop"] * 16)
    ones = np.ones(16, np.int32)
    bad.send_multipart(protocol.encode(group, ones[:3], ones, np.zeros(16, np.float32)))
    ack = protocol.decode(bad.recv_multipart())[0]
    assert isinstance(ack, protocol.Ack) and len(ack.groups) == 1
    assert (ack.groups[0].lease_id, ack.groups[0].prompt_id, ack.groups[0].accepted) == (999, 0, False)
    assert "lease" in ack.groups[0].reason
    bad.send_multipart(protocol.encode(group, ones[:3], ones, np.zeros(16, np.float32))[:-1])  # a frame short
    assert protocol.decode(bad.recv_multipart())[0].code == "bad_message"
    bad.close()
    m = scrape(lport)
    assert m['offpolicy_messages_rejected_total{reason="bad_message"}'] == 2
    assert m['offpolicy_messages_rejected_total{reason="protocol_version"}'] == 1
    # the hub is unharmed: a real rollout joins and the run completes
    start("rollout", "--index", "0", name="rollout0")
    assert learner.wait(180) == 0
    check_run_invariants(run_overrides.run_dir / "quickstart", 1)


def test_sigterm_stops_learner_cleanly_and_rollouts_follow(start, run_overrides):
    learner = start("learner", "learner.total_steps=100000", name="learner")
    rollout = start("rollout", "--index", "0", name="rollout0")
    metrics = run_overrides.run_dir / "quickstart" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, "3 steps")
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(60) == 0
    assert rollout.wait(60) == 0  # the learner's Goodbye ends the rollout
    summary = json.loads((run_overrides.run_dir / "quickstart" / "summary.json").read_text())
    assert summary["prompts_lost"] == 0 and summary["steps"] >= 3


def test_rollout_without_learner_fails_with_a_clear_message(run_overrides, tmp_path):
    res = subprocess.run(daemon_cmd("rollout", "--config", QUICKSTART, *run_overrides,
                                    "transport.connect_timeout_s=2"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "transport.connect_timeout_s" in res.stderr
