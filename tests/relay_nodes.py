"""Several "nodes" on one machine for relay tests: network identities, a learner side, relay daemons.

Each node gets its own address and its own store root. Where this process may create Linux network
namespaces (root, iproute2, veth and bridge support), every relay node lives in a namespace of its
own behind a bridge (10.x.y.2, .3, ...; the learner side is the bridge's 10.x.y.1), so nothing can
take a loopback shortcut; otherwise (or with OFFPOLICY_TEST_NETNS=0) the nodes are the loopback
addresses 127.0.0.2, 127.0.0.3, ... and the learner side is 127.0.0.1. Everything is removed after.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import torch
import zmq

from offpolicy.weights import Published, WeightStore, list_versions
from offpolicy.wire import protocol
from offpolicy.wire.keys import apply_client, apply_server, load_client, load_server
from tests.conftest import QUICKSTART, free_ports

RUN = "relaytest"


class Net:
    """Addresses of a learner side and `n` relay nodes; `prefix(i)` runs a command as node i."""

    def __init__(self, n: int, netns: bool = True):
        self.n, self.namespaces, self.bridge = n, [], None
        netns = netns and os.environ.get("OFFPOLICY_TEST_NETNS", "1") != "0"
        if netns and os.geteuid() == 0 and shutil.which("ip"):
            try:
                self._namespaces()
                self._probe()
                return
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
                self.close()
        self.kind, self.source = "loopback", "127.0.0.1"
        self.hosts = [f"127.0.0.{i + 2}" for i in range(n)]

    def _namespaces(self) -> None:
        tag = uuid.uuid4().hex[:6]
        routes = subprocess.run(["ip", "-4", "route"], check=True, capture_output=True, text=True).stdout
        subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        if f"{subnet}." in routes:
            raise OSError(f"{subnet}.0/24 is taken here")
        self.bridge = f"opb{tag}"
        ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self.hosts = []
        for i in range(self.n):
            ns, veth = f"op{tag}n{i}", f"op{tag}v{i}"
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            ip("-n", ns, "addr", "add", f"{subnet}.{i + 2}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            self.hosts.append(f"{subnet}.{i + 2}")
        self.kind, self.source = "netns", f"{subnet}.1"

    def _probe(self) -> None:
        """A TCP connection from every namespace to the learner side must get through the bridge."""
        with socket.socket() as listener:
            listener.bind((self.source, 0))
            listener.listen(self.n)
            code = f"import socket; socket.create_connection(({self.source!r}, {listener.getsockname()[1]}), 3)"
            for i in range(self.n):
                subprocess.run([*self.prefix(i), sys.executable, "-c", code], check=True, capture_output=True,
                               timeout=10)

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]] if self.kind == "netns" else []

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.namespaces, self.bridge = [], None


def random_tensors(mb: float, seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    """About `mb` MB of float32 tensors with distinct random bytes per seed."""
    rng = np.random.default_rng(seed)
    per = int(mb * 1e6 / 4 / n)
    return {f"model.layers.{i}.mlp.weight": torch.from_numpy(rng.standard_normal(per, dtype=np.float32))
            for i in range(n)}


class LearnerSide:
    """The learner node: a `WeightStore` and the learner's PUB socket announcing each version."""

    def __init__(self, root: str, host: str, announce_port: int, keep: int = 3, shard_bytes: int = 16 << 20,
                 keys: Path | None = None, checksum: str = "sha256"):
        self.root = root
        self.store = WeightStore(root, RUN, keep=keep, shard_bytes=shard_bytes, checksum=checksum)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.auth = None
        if keys is not None:  # a CurveZMQ learner: only allowlisted clients hear its announcements
            from zmq.auth.thread import ThreadAuthenticator

            server = load_server(keys)
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(server.allowlist))
            apply_server(self.pub, server)
        self.pub.bind(f"tcp://{host}:{announce_port}")

    def write(self, version: int, mb: float) -> Published:
        return self.store.publish(version, iter(random_tensors(mb, version).items()), {"model_type": "llama"})

    def announce_version(self, pub: Published) -> None:
        self.announce(protocol.WeightAnnouncement(version=pub.version, path=pub.path, total_bytes=pub.total_bytes,
                                                  publish_seconds=pub.seconds, step=pub.version))

    def publish(self, version: int, mb: float) -> None:
        self.announce_version(self.write(version, mb))

    def publish_damaged(self, version: int, mb: float) -> None:
        """Publish a version whose first shard no longer matches its manifest (damaged before it appears)."""
        pub = WeightStore(self.root + "-scratch", RUN).publish(
            version, iter(random_tensors(mb, version).items()), {"model_type": "llama"})
        flip_a_byte(Path(pub.path))
        final = Path(self.root) / RUN / f"v{version}"
        os.rename(pub.path, final)
        self.announce_version(msgspec.structs.replace(pub, path=str(final)))

    def announce(self, msg: protocol.Message) -> None:
        self.pub.send_multipart(protocol.encode(msg))

    def close(self) -> None:
        self.pub.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def relay_overrides(net: Net, port: int, announce_port: int, learner_announce: int, *extra: str) -> list[str]:
    """The config every node of a test cluster shares (per node: weights.root, metrics, --index or --serve)."""
    return ["--config", QUICKSTART, "run.name=" + RUN, f"relay.nodes=[{','.join(net.hosts)}]", f"relay.source={net.source}",
            f"transport.learner_host={net.source}", f"transport.announce_port={learner_announce}",
            f"relay.port={port}", f"relay.announce_port={announce_port}", *extra]


def start(cmd_prefix: list[str], args: list[str], log: Path) -> subprocess.Popen:
    cmd = [*cmd_prefix, sys.executable, "-m", "offpolicy.services.relay", *args]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def digests(path: str | Path) -> dict[str, str]:
    """sha256 of every file of a version directory (manifest.json included)."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(path).iterdir())}


class Announcements:
    """A SUB socket on each node's local PUB, collecting (version or 'goodbye') in arrival order."""

    def __init__(self, hosts: list[str], port: int, keys: Path | None = None):
        ctx = zmq.Context.instance()
        self.socks = []
        for h in hosts:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            if keys is not None:
                apply_client(s, load_client(keys, "rollout"))
            s.connect(f"tcp://{h}:{port}")
            self.socks.append(s)
        self.seen: list[list] = [[] for _ in hosts]

    def poll(self) -> None:
        for s, seen in zip(self.socks, self.seen):
            while s.poll(0):
                msg, _ = protocol.decode(s.recv_multipart())
                seen.append(msg.version if isinstance(msg, protocol.WeightAnnouncement) else "goodbye")

    def wait(self, nodes: list[int], version: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if all(version in self.seen[i] for i in nodes):
                return
            time.sleep(0.02)
        raise AssertionError(f"nodes {nodes} did not all announce version {version} in {timeout}s: {self.seen}")

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


def versions(root: str) -> list[int]:
    return list_versions(root, RUN)


def wait_ready(hosts: list[str], port: int, timeout: float = 20, keys: Path | None = None) -> None:
    """Each node's ROUTER answers a query (so its sockets, PUB included, are bound)."""
    ctx = zmq.Context.instance()
    for h in hosts:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            apply_client(s, load_client(keys, "rollout"))
        s.connect(f"tcp://{h}:{port}")
        deadline = time.monotonic() + timeout
        try:
            while True:
                s.send_multipart(protocol.encode(protocol.RelayQuery(want=1 << 40)))
                if s.poll(200):
                    # an offer, or the refusal of a node that does not relay the native format (relay.formats)
                    assert isinstance(protocol.decode(s.recv_multipart())[0], (protocol.RelayOffer, protocol.Error))
                    break
                assert time.monotonic() < deadline, f"relay node {h}:{port} did not answer in {timeout}s"
        finally:
            s.close(0)
    time.sleep(0.3)  # SUB sockets connected meanwhile have subscribed


class Cluster:
    """A learner side, its `offpolicy-relay --serve` source and `n` relay daemons, each node with its own
    address, store root, log and metrics port. `close()` stops every process and removes the namespaces."""

    def __init__(self, n: int, base: Path, logs: Path, *overrides: str, learner_keep: int = 3, netns: bool = True,
                 keys: Path | None = None, learner_checksum: str = "sha256"):
        self.net = Net(n, netns)
        self.base, self.logs, self.keys = base, logs, keys
        self.port, self.announce_port, learner_port = free_ports(3)
        self.metrics_ports = free_ports(n + 1)
        self.learner = LearnerSide(str(base / "learner"), self.net.source, learner_port, keep=learner_keep, keys=keys,
                                   checksum=learner_checksum)
        self.roots = [str(base / f"node{i}") for i in range(n)]
        curve = [] if keys is None else ["transport.curve=true", f"transport.keys_dir={keys}"]
        self.common = relay_overrides(self.net, self.port, self.announce_port, learner_port, *curve, *overrides)
        self.procs: dict[int, subprocess.Popen] = {}  # -1 = the source
        self.seen: Announcements | None = None

    def host(self, i: int) -> str:
        return self.net.source if i < 0 else self.net.hosts[i]

    def start(self, i: int) -> None:
        own = [f"metrics.host={self.host(i)}", f"relay.metrics_port={self.metrics_ports[i + 1]}"]
        if i < 0:
            args, prefix = [f"weights.root={self.learner.root}", *own, "--serve"], []
        else:
            args, prefix = [f"weights.root={self.roots[i]}", *own, "--index", str(i)], self.net.prefix(i)
        self.procs[i] = start(prefix, [*self.common, *args], self.logs / f"relay{i}.log")

    def start_all(self) -> None:
        for i in range(-1, self.net.n):
            self.start(i)
        wait_ready([self.net.source, *self.net.hosts], self.port, keys=self.keys)
        self.seen = Announcements(self.net.hosts, self.announce_port, keys=self.keys)
        time.sleep(0.2)

    def metrics(self, i: int) -> dict[str, float]:
        from tests.integration.helpers import scrape

        return scrape(self.metrics_ports[i + 1], self.host(i))

    def log(self, i: int) -> str:
        return (self.logs / f"relay{i}.log").read_text()

    def version_digests(self, root: str, version: int) -> dict[str, str]:
        return digests(Path(root) / RUN / f"v{version}")

    def close(self) -> None:
        stop_all(self.procs.values(), self.seen)
        self.learner.close()
        self.net.close()


def stop_all(procs, seen: Announcements | None) -> None:
    """Kill the relay processes still running, wait for every one, close the announcement listeners."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    if seen is not None:
        seen.close()


def flip_a_byte(path: Path) -> None:
    """Damage one byte in the middle of the first shard of a version (the size still matches)."""
    shard = sorted(path.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


class PartsCluster:
    """A learner on several nodes and the relays of the rollout nodes: learner node k has its store root
    `roots[k]` and its source (`offpolicy-relay --serve --index k`, `relay.sources`), each relay node its
    own store root and `offpolicy-relay --index i`; the learner's PUB is a socket of this process. Every
    node has its own address (`Net`): sources first, then relays. `close()` stops every process."""

    def __init__(self, roots: list[str], relays: int, base: Path, logs: Path, *overrides: str, run: str = RUN):
        self.k, self.n = len(roots), relays
        self.net = Net(self.k + relays)
        self.learner_roots, self.logs, self.run = roots, logs, run
        self.relay_roots = [str(base / f"rollout{i}") for i in range(relays)]
        self.port, self.announce_port, learner_port = free_ports(3)
        self.metrics_ports = free_ports(self.k + relays)
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://{self.net.source}:{learner_port}")
        self.common = ["--config", QUICKSTART, f"run.name={run}", f"relay.nodes=[{','.join(self.relay_hosts)}]",
                       f"relay.sources=[{','.join(self.source_hosts)}]", f"transport.learner_host={self.net.source}",
                       f"transport.announce_port={learner_port}", f"relay.port={self.port}",
                       f"relay.announce_port={self.announce_port}", *overrides]
        self.procs: dict[str, subprocess.Popen] = {}  # "source<k>", "relay<i>"
        self.seen: Announcements | None = None

    @property
    def source_hosts(self) -> list[str]:
        return self.net.hosts[:self.k]

    @property
    def relay_hosts(self) -> list[str]:
        return self.net.hosts[self.k:]

    def _own(self, slot: int) -> list[str]:
        return [f"metrics.host={self.net.hosts[slot]}", f"relay.metrics_port={self.metrics_ports[slot]}"]

    def start_source(self, k: int) -> None:
        args = [f"weights.root={self.learner_roots[k]}", *self._own(k), "--serve", "--index", str(k)]
        self.procs[f"source{k}"] = start(self.net.prefix(k), [*self.common, *args], self.logs / f"source{k}.log")

    def start_relay(self, i: int) -> None:
        args = [f"weights.root={self.relay_roots[i]}", *self._own(self.k + i), "--index", str(i)]
        self.procs[f"relay{i}"] = start(self.net.prefix(self.k + i), [*self.common, *args],
                                        self.logs / f"relay{i}.log")

    def start_all(self) -> None:
        for k in range(self.k):
            self.start_source(k)
        for i in range(self.n):
            self.start_relay(i)
        wait_ready(self.net.hosts, self.port)
        self.seen = Announcements(self.relay_hosts, self.announce_port)
        time.sleep(0.2)

    def stop(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def announce(self, msg: protocol.Message) -> None:
        self.pub.send_multipart(protocol.encode(msg))

    def announce_version(self, version: int) -> None:
        """The learner's announcement of `version` (rank 0's path: node 0's part)."""
        path = Path(self.learner_roots[0]) / self.run / "node0" / f"v{version}"
        self.announce(protocol.WeightAnnouncement(version=version, path=str(path), total_bytes=0, publish_seconds=0.0,
                                                  step=version))

    def metrics(self, name: str) -> dict[str, float]:
        from tests.integration.helpers import scrape

        slot = int(name[6:]) if name.startswith("source") else self.k + int(name[5:])
        return scrape(self.metrics_ports[slot], self.net.hosts[slot])

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def close(self) -> None:
        stop_all(self.procs.values(), self.seen)
        self.pub.close(0)
        self.ctx.term()
        self.net.close()
