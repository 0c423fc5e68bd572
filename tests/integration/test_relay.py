"""Integration tests of the cross-node weight relay: real `offpolicy-relay` subprocesses, each "node" with
its own network identity (a network namespace where this machine allows it, else its own loopback
address) and its own store in /dev/shm; a learner side in this process publishes versions and
announces them on a real PUB socket. Every node must end with the learner's bytes, in order, with the
learner sending each byte once; a middle node killed mid-transfer must not stop the nodes after it;
damaged versions and hostile peers must be refused and counted without stopping anything."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from offpolicy.config import WeightsConfig
from offpolicy.weights import WeightVersion, list_versions, subscribe
from offpolicy.weights.publisher import Publisher
from offpolicy.wire import protocol
from tests.integration.helpers import wait_for
from tests.relay_nodes import RUN, Cluster, digests, versions

FAST = ("relay.linger_s=1", "relay.peer_timeout_s=1.5", "run.log_level=DEBUG")


@pytest.fixture
def cluster(shm_root, tmp_path):
    made: list[Cluster] = []

    def make(n: int, *overrides: str, **kw) -> Cluster:
        c = Cluster(n, Path(shm_root), tmp_path, *FAST, *overrides, **kw)
        made.append(c)
        c.start_all()
        return c

    yield make
    for c in made:
        c.close()


def total_bytes(c: Cluster, version: int) -> int:
    return sum(f.stat().st_size for f in (Path(c.learner.root) / RUN / f"v{version}").iterdir()
               if f.name != "manifest.json")


def assert_same_bytes(c: Cluster, nodes: list[int], version: int) -> None:
    want = c.version_digests(c.learner.root, version)
    for i in nodes:
        assert c.version_digests(c.roots[i], version) == want, f"node {i} version {version} differs"


def test_a_chain_of_three_gets_every_version_in_order_and_the_learner_sends_each_byte_once(cluster):
    c = cluster(3)
    follower: list[int] = []
    node2_pub = f"tcp://{c.host(2)}:{c.announce_port}"

    def follow():  # the public subscribe API, unchanged, on node 2's own store and PUB socket
        for wv in subscribe(c.roots[2], RUN, announce=node2_pub, latest_only=False, verify=True, timeout_s=60):
            follower.append(wv.version)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    for v in range(3):  # back to back: the relays must keep every one (learner keep=3), in order
        c.learner.publish(v, 30)
    c.seen.wait([0, 1, 2], 2, timeout=120)
    source, tail = c.metrics(-1), c.metrics(2)
    nbytes = sum(total_bytes(c, v) for v in range(3))
    assert source['offpolicy_relay_bytes_total{direction="out"}'] == nbytes  # each byte left the learner once
    for i in range(3):
        m = c.metrics(i)
        assert m['offpolicy_relay_bytes_total{direction="in"}'] == nbytes
        assert m["offpolicy_relay_weight_version"] == 2 and m["offpolicy_relay_version_lag"] == 0
        assert m['offpolicy_relay_versions_total{outcome="complete"}'] == 3
        assert m["offpolicy_relay_transfer_seconds_count"] == 3
        assert m["offpolicy_relay_checksum_failures_total"] == 0
    assert tail['offpolicy_relay_bytes_total{direction="out"}'] == 0
    c.learner.announce(protocol.Goodbye(reason="done"))
    for i in (-1, 0, 1, 2):  # every node leaves on the learner's goodbye, after serving its downstream
        assert c.procs[i].wait(30) == 0, c.log(i)
    c.seen.poll()
    assert c.seen.seen == [[0, 1, 2, "goodbye"]] * 3
    for v in range(3):
        assert_same_bytes(c, [0, 1, 2], v)
    t.join(10)
    assert follower == [0, 1, 2] and not t.is_alive()  # ended on the relayed goodbye


def test_killing_the_middle_node_mid_transfer_still_delivers_to_the_node_after_it(cluster):
    c = cluster(3, "relay.window=1", "relay.chunk_bytes=131072")
    c.learner.publish(0, 60)
    staging = lambda i: list((Path(c.roots[i]) / RUN).glob(".v0.tmp-*"))  # noqa: E731
    wait_for(lambda: staging(2) and not versions(c.roots[1]), 60, "node 2 pulling version 0 from node 1", 0.005)
    c.procs[1].kill()
    c.procs[1].wait()
    assert versions(c.roots[1]) == [], "node 1 finished before it was killed: the test proved nothing"
    c.seen.wait([0, 2], 0, timeout=120)
    assert_same_bytes(c, [0, 2], 0)
    m2 = c.metrics(2)
    assert m2["offpolicy_relay_upstream_switches_total"] == 1
    assert "re-attaching to tcp://" + c.host(0) in c.log(2)
    c.learner.publish(1, 20)  # the healed chain goes on: node 2 now pulls from node 0
    c.seen.wait([0, 2], 1, timeout=120)
    assert_same_bytes(c, [0, 2], 1)
    assert c.metrics(-1)['offpolicy_relay_bytes_total{direction="out"}'] == total_bytes(c, 0) + total_bytes(c, 1)
    assert c.seen.seen[0] == [0, 1] and c.seen.seen[2] == [0, 1]


def test_a_version_failing_its_checksum_is_refused_and_the_previous_one_kept(cluster):
    c = cluster(2)
    c.learner.publish(0, 10)
    c.seen.wait([0, 1], 0, timeout=60)
    c.learner.publish_damaged(1, 10)
    wait_for(lambda: c.metrics(0)["offpolicy_relay_checksum_failures_total"] == 1, 60, "node 0 refusing v1")
    c.learner.publish(2, 10)
    c.seen.wait([0, 1], 2, timeout=60)
    assert c.seen.seen == [[0, 2], [0, 2]]  # version 1 was never announced on any node
    for i in range(2):
        assert versions(c.roots[i]) == [0, 2]
        assert not [p for p in (Path(c.roots[i]) / RUN).iterdir() if p.name.startswith(".")]
        assert_same_bytes(c, [i], 2)
    m1 = c.metrics(1)  # node 1 was told v1 is gone, or saw the bad bytes itself: refused either way
    assert m1['offpolicy_relay_versions_total{outcome="complete"}'] == 2
    assert m1.get('offpolicy_relay_versions_total{outcome="skipped"}', 0) + \
        m1.get('offpolicy_relay_versions_total{outcome="refused"}', 0) == 1


def test_with_curve_only_allowlisted_peers_fetch_or_hear_and_the_chain_still_delivers(cluster, tmp_path):
    """transport.curve: the relays serve shards and announcements to allowlisted keys only, and
    authenticate themselves to the learner's PUB and to their upstream; versions arrive as without."""
    from offpolicy.wire.keys import generate

    keys = tmp_path / "keys"
    generate(keys, ["rollout"])
    c = cluster(2, keys=keys)
    c.learner.publish(0, 10)
    c.learner.publish(1, 10)
    c.seen.wait([0, 1], 1, timeout=60)
    for v in (0, 1):
        assert_same_bytes(c, [0, 1], v)
    assert "(CurveZMQ)" in c.log(0)
    ctx = zmq.Context.instance()
    plain = ctx.socket(zmq.DEALER)  # no keys: the handshake fails, nothing is served
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(f"tcp://{c.host(0)}:{c.port}")
    with contextlib.suppress(zmq.Again):
        plain.send_multipart(protocol.encode(protocol.RelayQuery(want=1 << 40)), flags=zmq.NOBLOCK)
    listener = ctx.socket(zmq.SUB)
    listener.setsockopt(zmq.LINGER, 0)
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.connect(f"tcp://{c.host(0)}:{c.announce_port}")
    time.sleep(0.5)
    c.learner.publish(2, 1)
    c.seen.wait([0, 1], 2, timeout=60)
    assert not plain.poll(1000) and not listener.poll(0)
    plain.close(0)
    listener.close(0)


def test_hostile_frames_are_counted_and_ignored(cluster):
    c = cluster(1)
    ctx = zmq.Context.instance()
    junk = [[b"\xc1"], [b""], [b"\x93\x01\x02\x03"], [protocol.encode(protocol.RelayQuery(want=0))[0], b"extra"],
            protocol.encode(protocol.ChunkRequest(version=0, file="../../etc/passwd", offset=0, length=10)),
            protocol.encode(protocol.Chunk(version=0, file="x", offset=0, length=3), np.frombuffer(b"abc", np.uint8))]
    for i in (-1, 0):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{c.host(i)}:{c.port}")
        for frames in junk:
            s.send_multipart(frames)
            assert s.poll(5000), f"node {i} did not answer {frames!r}"
            assert isinstance(protocol.decode(s.recv_multipart())[0], (protocol.Error, protocol.RelayMissing))
        s.close(0)
    for frames in ([b"junk on the learner's PUB"], [b"\xc1", b"\x00"]):
        c.learner.pub.send_multipart(frames)
    c.learner.publish(0, 10)
    c.seen.wait([0], 0, timeout=60)
    assert_same_bytes(c, [0], 0)
    for i in (-1, 0):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{c.host(i)}:{c.port}")
        s.send_multipart(junk[4])  # version 0 is there now, but it has no such file
        assert s.poll(5000) and protocol.decode(s.recv_multipart())[0].code == "bad_request"
        s.close(0)
        m = c.metrics(i)
        assert m['offpolicy_messages_rejected_total{reason="bad_message"}'] == 6  # 4 from us, 2 on the PUB
        assert m['offpolicy_messages_rejected_total{reason="unexpected"}'] == 1
        assert m['offpolicy_messages_rejected_total{reason="bad_request"}'] == 1
        assert c.procs[i].poll() is None
    assert not Path(c.roots[0]).parent.joinpath("etc").exists()


def test_a_rollout_on_a_relay_node_hears_each_version_from_its_relay_and_unhashed_chunks_are_crc_checked(cluster):
    """The defaults of a GPU learner (weights.checksum none: the relay checks every chunk against the source's
    CRC-32) and a rollout with rollout.announce=relay: its follower (the daemon's own) learns of each version
    from the relay's PUB once the version is in this node's store; the store-scan fallback is set to a minute,
    so nothing else could tell it in time."""
    from offpolicy.config import load_config
    from offpolicy.rollout.daemon import VersionFollower, announce_address
    from tests.conftest import QUICKSTART

    c = cluster(2, learner_checksum="none")
    node = load_config(QUICKSTART, [*c.common[2:], f"weights.root={c.roots[1]}", "rollout.announce=relay",
                                    f"relay.bind_host={c.host(1)}"])
    assert announce_address(node) == f"tcp://{c.host(1)}:{c.announce_port}"
    follower = VersionFollower(node, announce_address(node), poll_s=60)
    follower.thread.start()
    time.sleep(0.3)  # subscribed
    try:
        for v in range(3):
            c.learner.publish(v, 10)
            t0 = time.monotonic()
            wv = follower.take(v, timeout=45)
            assert wv is not None and wv.version == v, f"version {v} not heard of in 45 s"
            assert time.monotonic() - t0 < 45 and not any(e.sha256 for e in wv.manifest.files.values())
            assert versions(c.roots[1])[-1] == v  # it is in this node's store when announced
            wv.close()
        c.seen.wait([0, 1], 2, timeout=30)
        assert_same_bytes(c, [0, 1], 2)
        for i in range(2):
            m = c.metrics(i)
            assert m['offpolicy_relay_versions_total{outcome="complete"}'] == 3
            assert m["offpolicy_relay_checksum_failures_total"] == 0
    finally:
        c.learner.announce(protocol.Goodbye(reason="done"))  # the relays pass it on: the follower ends
        follower.thread.join(30)
        follower.close()
    assert not follower.thread.is_alive()


def test_old_versions_are_collected_by_keep_but_not_while_a_reader_holds_them(cluster):
    c = cluster(1, "weights.keep=2")
    c.learner.publish(0, 5)
    c.seen.wait([0], 0, timeout=60)
    reader = WeightVersion(Path(c.roots[0]) / RUN / "v0")  # a rollout on node 0 still uses version 0
    for v in (1, 2, 3):
        c.learner.publish(v, 5)
        c.seen.wait([0], v, timeout=60)
    assert versions(c.roots[0]) == [0, 2, 3]
    reader.close()
    wait_for(lambda: versions(c.roots[0]) == [2, 3], 10, "version 0 collected once released")


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["all-alive", "kill-node-1"])
def test_four_nodes_few_hundred_mb(cluster, kill):
    c = cluster(4, "relay.peer_timeout_s=2")
    c.learner.publish(0, 300)
    if kill:
        wait_for(lambda: list((Path(c.roots[3]) / RUN).glob(".v0.tmp-*")) and not versions(c.roots[1]), 120,
                 "node 3 pulling version 0", 0.005)
        c.procs[1].kill()
        c.procs[1].wait()
    alive = [0, 2, 3] if kill else [0, 1, 2, 3]
    c.seen.wait(alive, 0, timeout=300)
    c.learner.publish(1, 300)
    c.seen.wait(alive, 1, timeout=300)
    for v in (0, 1):
        assert_same_bytes(c, alive, v)
    for i in alive:
        assert c.seen.seen[i] == [0, 1]
    assert c.metrics(-1)['offpolicy_relay_bytes_total{direction="out"}'] == total_bytes(c, 0) + total_bytes(c, 1)
    if kill:
        assert versions(c.roots[1]) == []
        assert c.metrics(2)["offpolicy_relay_upstream_switches_total"] == 1


@pytest.mark.parametrize("overrides, carried", [([], ["native", "fp8"]),
                                                (["relay.formats=[fp8]", "rollout.weights_format=fp8"], ["fp8"])],
                         ids=["all-formats", "fp8-only"])
def test_relays_carry_every_weight_format_and_can_be_limited_to_one(cluster, overrides, carried):
    named = [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(512, 512, generator=torch.Generator().manual_seed(i)))
             for i in range(4)]
    c = cluster(2, "weights.formats=[fp8]", *overrides)
    b = Publisher(WeightsConfig(root=c.learner.root, keep=3, formats=["fp8"]), RUN)
    runs = {"native": RUN, "fp8": f"{RUN}/fp8"}
    for v in range(2):  # v1 only once every node holds v0: a relay joining late pulls just the newest version
        c.learner.announce_version(b.publish(v, lambda: named, {"model_type": "llama"}))
        wait_for(lambda: all(v in list_versions(c.roots[i], runs[f]) for i in range(2) for f in carried), 60,
                 f"every node holding version {v} in {carried}")
    for i in range(2):
        wait_for(lambda: all(list_versions(c.roots[i], runs[f]) == [0, 1] for f in carried), 60,
                 f"node {i} holding versions 0 and 1 in {carried}")
        for f in carried:
            for v in range(2):
                assert digests(Path(c.roots[i]) / runs[f] / f"v{v}") == digests(Path(c.learner.root) / runs[f] / f"v{v}")
        if carried == ["fp8"]:
            assert list_versions(c.roots[i], RUN) == []  # native was not carried
    with WeightVersion(Path(c.roots[1]) / RUN / "fp8" / "v1", verify=True) as wv:
        assert wv.manifest.format == "fp8" and wv.tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    sent = sum(f.stat().st_size for r in carried for v in range(2)
               for f in (Path(c.learner.root) / runs[r] / f"v{v}").iterdir() if f.name != "manifest.json")
    out = c.metrics(-1)['offpolicy_relay_bytes_total{direction="out"}']
    # node 1 pulls through node 0, so the source serves each byte of each format once. On a loaded machine an
    # upstream can stay silent past relay.peer_timeout_s: the relay heals (logged; node 1 onto the source) and
    # asks again for the chunks it still missed, so the source serves some bytes twice, never more
    healed = [i for i in range(2) if "re-attaching to" in c.log(i)]
    if not healed:
        assert out == sent, (out, sent)
    else:
        assert sent <= out <= 2 * sent, (out, sent, healed)
    c.learner.announce(protocol.Goodbye(reason="done"))
    for i in (-1, 0, 1):
        assert c.procs[i].wait(30) == 0, c.log(i)



def test_a_second_relay_on_a_live_relays_store_is_refused_and_clears_nothing(cluster, tmp_path):
    """A relay owns its node's store (the store lock): a second one started on it (other ports, same
    weights.root) exits 2 in one line before it clears anything, and the live relay's versions stay."""
    import subprocess
    import sys

    from tests.conftest import free_ports

    c = cluster(1)
    c.learner.publish(0, 30)
    c.seen.wait([0], 0, timeout=120)
    port, announce = free_ports(2)
    own = [f"weights.root={c.roots[0]}", "--index", "0", f"relay.port={port}", f"relay.announce_port={announce}"]
    res = subprocess.run([*c.net.prefix(0), sys.executable, "-m", "offpolicy.services.relay", *c.common, *own],
                         capture_output=True, text=True, timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2 and err.startswith("error: ") and "\n" not in err, res.stderr
    assert f"run '{RUN}' is live" in err and "a second relay" in err and "the lock of weights.root" in err
    assert versions(c.roots[0]) == [0]
