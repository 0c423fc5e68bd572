"""Swap latency on a relay node: from the learner's announcement to the version loaded by a rollout there.

    .venv/bin/python benchmarks/relay_swap.py --mb 64 --repeat 10

A learner side (this process: a `WeightStore` with `--checksum`, and the learner's PUB socket), then
`offpolicy-relay --serve` and one `offpolicy-relay` (real subprocesses; the node on 127.0.0.2 with a
store of its own in /dev/shm) relay each version. On that node, two rollouts' weight paths follow the
node's store at once, each the daemon's own `VersionFollower` (`subscribe`, store scan every 0.25 s)
with the announce address that `rollout.announce` gives it: `learner` (the learner's PUB: how rollouts
listened before) and `relay` (the node's relay PUB). For each version both wait for it as an idle
rollout's swap does (`VersionFollower.take`), so both see the same transfer; then it is loaded once
with `transfer.load_version` into preallocated tensors (the torch engine's load, CPU here).

Per version: relay s = learner's announcement -> the relay's own announcement (the version is in the
node's store); notice s = that -> the follower hands the version over; load s; swap s = relay + notice
+ load, i.e. announcement to loaded. Medians and maxima over `--repeat` versions after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import zmq  # noqa: E402

from offpolicy.config import load_config  # noqa: E402
from offpolicy.wire import protocol  # noqa: E402
from offpolicy.rollout.daemon import VersionFollower, announce_address  # noqa: E402
from offpolicy.weights.transfer import load_version  # noqa: E402
from tests.conftest import QUICKSTART, free_ports  # noqa: E402
from tests.relay_nodes import LearnerSide, Net, random_tensors, relay_overrides, start, wait_ready  # noqa: E402

MODES = ("learner", "relay")


class Heard(threading.Thread):
    """Arrival times of WeightAnnouncements on one SUB socket, by version."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.at: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(100):
                msg, _ = protocol.decode(self.sock.recv_multipart())
                if isinstance(msg, protocol.WeightAnnouncement):
                    self.at.setdefault(msg.version, time.monotonic())

    def wait(self, version: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while version not in self.at:
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} was not announced in {timeout}s")
            time.sleep(0.001)
        return self.at[version]


def measure(args, base: Path) -> list[dict]:
    net = Net(1, netns=False)
    port, announce, learner_port = free_ports(3)
    learner = LearnerSide(str(base / "learner"), net.source, learner_port, keep=3, shard_bytes=1 << 30,
                          checksum=args.checksum)
    common = relay_overrides(net, port, announce, learner_port, "relay.linger_s=0.5", "run.log_level=WARNING")
    node_root = base / "node0"
    logs = base / "logs"
    logs.mkdir()
    procs = [start([], [*common, f"weights.root={learner.root}", "--serve"], logs / "source.log"),
             start([], [*common, f"weights.root={node_root}", "--index", "0"], logs / "relay.log")]
    followers, takers = {}, []
    got: dict[str, dict[int, tuple[float, object]]] = {m: {} for m in MODES}
    stop = threading.Event()
    try:
        wait_ready([net.source, *net.hosts], port)
        relay_heard = Heard(f"tcp://{net.hosts[0]}:{announce}")
        relay_heard.start()
        for mode in MODES:  # a rollout on node 0, as `offpolicy-rollout` would be configured
            cfg = load_config(QUICKSTART, [*common[2:], f"weights.root={node_root}", f"rollout.announce={mode}",
                                           f"relay.bind_host={net.hosts[0]}"])
            followers[mode] = VersionFollower(cfg, announce_address(cfg))
            followers[mode].thread.start()

            def take(mode=mode):
                v = 0
                while not stop.is_set():
                    wv = followers[mode].take(v, 1.0)
                    if wv is not None:
                        got[mode][wv.version] = (time.monotonic(), wv)
                        v = wv.version + 1

            takers.append(threading.Thread(target=take, daemon=True))
            takers[-1].start()
        time.sleep(0.5)  # every SUB socket subscribed
        dest = {k: torch.empty_like(t) for k, t in random_tensors(args.mb, 0).items()}
        rows = []
        for v in range(args.repeat + 1):
            published = learner.write(v, args.mb)
            t0 = time.monotonic()
            learner.announce_version(published)
            relayed = relay_heard.wait(v, 600)
            deadline = time.monotonic() + 60
            while not all(v in got[m] for m in MODES):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {v}: followers have {[sorted(got[m]) for m in MODES]}")
                time.sleep(0.001)
            wv = got["relay"][v][1]
            t1 = time.perf_counter()
            load_version(dest, wv.path)
            load = time.perf_counter() - t1
            for m in MODES:
                got[m][v][1].close()
            if v:  # version 0 warms up (and is a late joiner's first version)
                rows.append({"version": v, "relay_s": relayed - t0, "load_s": load,
                             **{f"notice_{m}_s": got[m][v][0] - relayed for m in MODES}})
        relay_heard.stop.set()
        return rows
    finally:
        stop.set()
        for f in followers.values():
            f.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        learner.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64, help="MB per weight version")
    p.add_argument("--repeat", type=int, default=10, help="timed versions (after one warm-up)")
    p.add_argument("--checksum", choices=["none", "sha256"], default="none",
                   help="the learner's weights.checksum (none: the relay checks chunk CRC-32s)")
    args = p.parse_args()
    base = Path("/dev/shm") / f"offpolicy-swap-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    load_before = os.getloadavg()[0]
    try:
        rows = measure(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{args.mb:g} MB per version, learner checksum {args.checksum}, one relay node; {len(rows)} timed "
          f"versions, median (max); {os.cpu_count()} CPUs, load average {load_before:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| rollout.announce | relay s (announce -> in the node's store) | notice s | load s | "
          "swap s (announce -> loaded) |")
    print("| --- | --- | --- | --- | --- |")

    def cell(key) -> str:
        vals = [key(r) for r in rows]
        return f"{statistics.median(vals):.3f} ({max(vals):.3f})"

    for m in MODES:
        print(f"| {m} | {cell(lambda r: r['relay_s'])} | {cell(lambda r: r[f'notice_{m}_s'])} | "
              f"{cell(lambda r: r['load_s'])} | {cell(lambda r: r['relay_s'] + r[f'notice_{m}_s'] + r['load_s'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
