"""CurveZMQ: an unauthenticated or unknown peer can neither lease prompts, submit samples, nor hear
announcements; an allowlisted rollout trains as usual. Counters on both sides say so."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq

from offpolicy.wire import protocol
from offpolicy.wire.keys import apply_client, generate, load_client
from tests.conftest import QUICKSTART, daemon_cmd, free_ports
from tests.integration.helpers import scrape, stop_all, wait_for


def intruder_traffic(kind: int, address: str, keys=None, seconds: float = 3.0) -> int:
    """Connect, try Hello + WorkRequest + a forged group (DEALER) or listen (SUB); count what comes back."""
    ctx = zmq.Context.instance()
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        apply_client(s, keys)
    s.connect(address)
    if kind == zmq.DEALER:
        for msg, arrays in [(protocol.Hello(daemon_id="intruder", engine="x", max_groups=8), ()),
                            (protocol.WorkRequest(credits=8), ()),
                            (protocol.SampleGroup(lease_id=1, prompt_id=0, epoch=0, weight_version=0,
                                                  response_lengths=[1] * 16, rewards=[1.0] * 16,
                                                  finish_reasons=["stop"] * 16),
                             (np.ones(3, np.int32), np.ones(16, np.int32), np.zeros(16, np.float32)))]:
            try:
                s.send_multipart(protocol.encode(msg, *arrays), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection was ever established: nothing can be queued
    received, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        if s.poll(100):
            s.recv_multipart()
            received += 1
    s.close(0)
    return received


@pytest.fixture
def keys(tmp_path):
    generate(tmp_path / "keys", ["rollout"])
    generate(tmp_path / "other", ["stranger"])  # a valid key pair the learner has never heard of
    return tmp_path


def test_only_allowlisted_clients_get_through(run_overrides, keys, tmp_path):
    lport, = free_ports(1)
    curve = ["transport.curve=true", f"transport.keys_dir={keys / 'keys'}"]
    procs = []
    try:
        learner = subprocess.Popen(daemon_cmd("learner", "--config", QUICKSTART, *run_overrides, *curve,
                                              "learner.total_steps=5", f"metrics.port={lport}"),
                                   stdout=open(tmp_path / "learner.log", "w"), stderr=subprocess.STDOUT)
        procs.append(learner)
        wait_for(lambda: scrape(lport).get("offpolicy_weight_version") == 0, 60, "version 0")
        work = f"tcp://127.0.0.1:{run_overrides.work_port}"
        pub = f"tcp://127.0.0.1:{run_overrides.announce_port}"
        stranger = load_client(keys / "other", "stranger")
        stranger = type(stranger)(server_public=load_client(keys / "keys", "rollout").server_public,
                                  public=stranger.public, secret=stranger.secret)
        intruders = {"plain dealer": (zmq.DEALER, work), "unknown-key dealer": (zmq.DEALER, work, stranger),
                     "plain sub": (zmq.SUB, pub), "unknown-key sub": (zmq.SUB, pub, stranger)}
        with ThreadPoolExecutor(len(intruders)) as pool:  # side by side: each listens its full 3 s
            futures = {name: pool.submit(intruder_traffic, *args) for name, args in intruders.items()}
        got = {name: f.result() for name, f in futures.items()}
        assert got == {k: 0 for k in got}, got
        def refused(m):
            return sum(v for k, v in m.items() if k.startswith("offpolicy_connection_events_total") and "_failed" in k)

        # monitor events arrive asynchronously: the two unknown keys fail authentication, the two plain
        # sockets fail the handshake (each may retry, so these are lower bounds)
        m = wait_for(lambda: (m := scrape(lport)).get('offpolicy_connection_events_total{event="auth_failed"}', 0)
                     >= 2 and refused(m) >= 4 and m, 20, "four refused handshakes to be counted")
        assert m["offpolicy_leases_issued_total"] == 0 and m["offpolicy_groups_received_total"] == 0
        assert sum(v for k, v in m.items() if k.startswith("offpolicy_messages_rejected_total")) == 0
        # the allowlisted rollout trains as usual
        procs.append(subprocess.Popen(daemon_cmd("rollout", "--config", QUICKSTART, *run_overrides, *curve,
                                                 "transport.client_key=rollout"),
                                      stdout=open(tmp_path / "rollout.log", "w"), stderr=subprocess.STDOUT))
        assert learner.wait(120) == 0
    finally:
        stop_all(procs)
    log = (tmp_path / "learner.log").read_text()
    assert "CurveZMQ" in log
    assert "refused a connection" in log


def test_missing_keys_name_the_fix(run_overrides, tmp_path):
    res = subprocess.run(daemon_cmd("learner", "--config", QUICKSTART, *run_overrides, "transport.curve=true",
                                    f"transport.keys_dir={tmp_path / 'nokeys'}"),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "offpolicy keys" in res.stderr
