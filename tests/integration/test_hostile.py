"""Hostile and broken peers against a live hub: fuzzed frames and floods.

- Fuzz: 10,000 random and mutated frames; the hub never crashes, counts every frame that does not
  decode, and the run still learns afterwards.
- Flood: a peer pushing sample groups far faster than the learner consumes, another sending oversize
  messages; the learner's resident memory stays bounded, the sender sees refusals (EAGAIN).
"""

from __future__ import annotations

import random
import subprocess
import time

import numpy as np
import pytest
import zmq

from offpolicy.wire import protocol
from tests.conftest import QUICKSTART, daemon_cmd, free_ports
from tests.integration.helpers import check_run_invariants, scrape, stop_all, wait_for

N_FUZZ = 10_000


def templates() -> list[list[bytes]]:
    group = protocol.SampleGroup(lease_id=(7 << 32) + 1, prompt_id=3, epoch=0, weight_version=0,
                                 response_lengths=[2] * 16, rewards=[0.5] * 16, finish_reasons=["stop"] * 16)
    msgs = [
        (protocol.Hello(daemon_id="fuzz", engine="torch", max_groups=8), ()),
        (protocol.Heartbeat(daemon_id="fuzz", weight_version=0, busy_groups=0), ()),
        (protocol.VersionQuery(), ()),
        (protocol.WorkRequest(credits=0), ()),
        (group, (np.arange(6, dtype=np.int32), np.ones(32, np.int32), np.full(32, -0.5, np.float32))),
        (protocol.Lease(lease_id=1, min_version=0, deadline_s=5.0,
                        prompts=[protocol.LeasePrompt(prompt_id=1, epoch=0, n_tokens=3)]), (np.ones(3, np.int32),)),
    ]
    return [[bytes(f) for f in protocol.encode(m, *a)] for m, a in msgs]


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(7)
    i = rng.randrange(len(frames))
    if op == 0:  # random bytes everywhere
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 5))]
    if op == 1:  # flip bits
        b = bytearray(frames[i])
        for _ in range(rng.randrange(1, 4)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(b)
    elif op == 2:  # truncate
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif op == 3:  # drop a frame
        frames.pop(i)
    elif op == 4:  # add a frame
        frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(0, 40)))
    elif op == 5:  # resize an array frame
        frames[i] = frames[i] + b"\x00" * rng.choice([1, 3, 4, 8])
    else:  # replace a header value with a hostile one
        raw = protocol.msgspec.msgpack.decode(frames[0])
        key = rng.choice(list(raw))
        raw[key] = rng.choice([-1, 2**63 - 1, "x" * 1000, None, [], {"a": 1}, 1e308, float("nan")])
        frames[0] = protocol.msgspec.msgpack.encode(raw)
    return frames or [b""]


def expected_rejection(frames: list[bytes]) -> bool:
    try:
        protocol.decode(frames)
        return False
    except protocol.ProtocolError:
        return True


@pytest.fixture
def learner(run_overrides, tmp_path):
    procs = []

    def start(*extra):
        lport, = free_ports(1)
        p = subprocess.Popen(daemon_cmd("learner", "--config", QUICKSTART, *run_overrides, f"metrics.port={lport}",
                                        *extra), stdout=open(tmp_path / "learner.log", "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        wait_for(lambda: scrape(lport).get("offpolicy_weight_version") == 0, 60, "version 0")
        return p, lport

    def rollout(*extra):
        procs.append(subprocess.Popen(daemon_cmd("rollout", "--config", QUICKSTART, *run_overrides, *extra),
                                      stdout=open(tmp_path / "rollout.log", "a"), stderr=subprocess.STDOUT))

    start.rollout = rollout
    yield start
    stop_all(procs)


@pytest.mark.slow  # ~25 s of a live run; hostile and malformed messages (test_daemons, test_protocol) and floods stay in the default suite
def test_fuzzed_frames_never_crash_the_hub_and_the_run_still_learns(learner, run_overrides):
    # a short heartbeat timeout: the fuzzing peer, silent after its frames, gives its leases back sooner
    proc, port = learner("learner.total_steps=150", "transport.heartbeat_timeout_s=6")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{run_overrides.work_port}")
    sock.send_multipart(templates()[0])  # a Hello first, so mutated messages reach the deeper checks
    rng, base = random.Random(1234), templates()
    rejected = 0
    for i in range(N_FUZZ):
        frames = mutate(rng, rng.choice(base))
        rejected += expected_rejection(frames)
        sock.send_multipart(frames)
        while sock.poll(0):
            sock.recv_multipart()  # read the hub's answers so they never pile up
    assert rejected > N_FUZZ // 2
    counted = lambda: sum(v for k, v in scrape(port).items() if k.startswith("offpolicy_messages_rejected_total")  # noqa: E731
                          and ("bad_message" in k or "protocol_version" in k))
    wait_for(lambda: counted() >= rejected, 60, f"{rejected} rejections to be counted")
    assert counted() == rejected
    assert proc.poll() is None  # alive
    sock.close(0)
    learner.rollout("--index", "0")
    assert proc.wait(240) == 0
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)
    assert summary["final_reward_mean"] > summary["initial_reward_mean"] + 0.2
    print(f"fuzz: {N_FUZZ} frames, {rejected} undecodable (all counted), 0 crashes; then reward "
          f"{summary['initial_reward_mean']:.3f} -> {summary['final_reward_mean']:.3f}")


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


BOUND_MB = 150
FLOOD_S = 6  # ~120,000 groups on 2 cores: a hub that kept what it refuses outgrew BOUND_MB within it


def test_flood_keeps_learner_memory_bounded(learner, run_overrides):
    proc, port = learner("learner.total_steps=100000")
    learner.rollout("--index", "0")
    wait_for(lambda: scrape(port).get("offpolicy_weight_version", 0) >= 2, 60, "training to start")
    baseline = rss_mb(proc.pid)
    ctx = zmq.Context.instance()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 1000)
    flood.connect(f"tcp://127.0.0.1:{run_overrides.work_port}")
    flood.send_multipart(templates()[0])
    group = templates()[4]
    sent = refused = 0
    deadline = time.monotonic() + FLOOD_S
    while time.monotonic() < deadline:
        try:
            flood.send_multipart(group, flags=zmq.NOBLOCK)  # never reads the hub's answers either
            sent += 1
        except zmq.Again:
            refused += 1  # the sender sees the back-pressure
            time.sleep(0.001)
    big = ctx.socket(zmq.DEALER)  # oversize messages: ZeroMQ drops the peer before allocating them
    big.setsockopt(zmq.LINGER, 0)
    big.connect(f"tcp://127.0.0.1:{run_overrides.work_port}")
    huge = [group[0], b"\x01" * (8 << 20), group[2], group[3]]
    for _ in range(50):
        try:
            big.send_multipart(huge, flags=zmq.NOBLOCK)
        except zmq.Again:
            break
    # ZeroMQ drops the oversize sender (maxmsgsize) before allocating its messages: the hub's monitor counts it
    m = wait_for(lambda: (m := scrape(port)).get('offpolicy_connection_events_total{event="disconnected"}', 0) >= 1
                 and m, 30, "the oversize sender to be disconnected")
    peak = rss_mb(proc.pid, "VmHWM")
    flood.close(0)
    big.close(0)
    assert proc.poll() is None
    assert refused > 0
    assert peak - baseline < BOUND_MB, f"learner grew from {baseline:.0f} MB to a peak of {peak:.0f} MB"
    dropped = sum(v for k, v in m.items() if k.startswith("offpolicy_groups_dropped_total"))
    assert dropped > 1000  # the flood was processed and refused, not silently lost
    assert m.get('offpolicy_connection_events_total{event="disconnected"}', 0) >= 1  # the oversize sender
    print(f"flood: {sent} groups sent in {FLOOD_S} s ({refused} sends refused by back-pressure), {dropped:.0f} refused "
          f"by the hub; learner RSS {baseline:.0f} MB -> peak {peak:.0f} MB (bound {BOUND_MB} MB)")
