"""Relay throughput for 1, 2, 4 ... chained nodes on loopback, as a ratio to one raw ZeroMQ transfer.

    .venv/bin/python benchmarks/relay.py --mb 512 --nodes 1 2 4

A learner-side store (this process) publishes versions of `--mb` MB; `offpolicy-relay --serve` and N
`offpolicy-relay` daemons (real subprocesses, nodes on 127.0.0.2, 127.0.0.3, ...; each its own store in
/dev/shm) relay each version down the chain. A round is timed from the learner's announcement to the
last node's local announcement (its files verified and renamed into place); the first version warms up
and is not timed. Right before each timed version, the raw transfer sends the previous version's shard
bytes once over one ZeroMQ PUSH -> PULL connection on loopback (4 MiB zero-copy frames from a map of
the learner's files) into a new file in /dev/shm on the receiving side: the floor any relay pays, with
no protocol, no checksums and no chaining. Prints a markdown table of medians over `--repeat` rounds;
the ratio is the median of each round's raw seconds / relay seconds (in brackets: best / best).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from tests.conftest import free_ports  # noqa: E402
from tests.relay_nodes import (  # noqa: E402
    RUN, Announcements, LearnerSide, Net, relay_overrides, start, wait_ready,
)

FRAME = 4 << 20


def raw_receiver(address: str, path: str, total: int) -> None:
    """Child process: PULL `total` bytes into a new file at `path`; print the monotonic time of the last one."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(address)
    print("ready", flush=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, total)
    got = 0
    while got < total:
        frame = sock.recv(copy=False)
        os.pwrite(fd, frame.buffer, got)
        got += len(frame.buffer)
    print(time.monotonic(), flush=True)
    os.close(fd)


def raw_transfer(version_dir: Path, host: str, port: int, scratch: Path) -> float:
    """Seconds to move every shard of `version_dir` once over one ZeroMQ connection into /dev/shm."""
    shards = sorted(version_dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in shards)
    target = scratch / f"raw-{uuid.uuid4().hex[:6]}"
    child = subprocess.Popen([sys.executable, __file__, "--raw-receiver", f"tcp://{host}:{port}", str(target),
                              str(total)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(f"tcp://{host}:{port}")
    time.sleep(0.3)  # connected
    maps = []
    for f in shards:
        with open(f, "rb") as fh:
            maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    t0 = time.monotonic()
    for mm in maps:
        view = memoryview(mm)
        for off in range(0, len(mm), FRAME):
            sock.send(view[off: off + FRAME], copy=False)
    end = float(child.stdout.readline())
    child.wait()
    sock.close(0)
    target.unlink()
    return end - t0


def rounds(n: int, mb: float, repeat: int, base: Path, window: int, chunk_mb: int,
           checksum: str = "sha256") -> tuple[list[tuple[float, float, int]], dict[str, float]]:
    """(relay seconds to the last of `n` chained nodes, raw seconds, bytes) for each of `repeat` timed versions,
    and the CPU seconds per GB relayed of the source and of the average relay over the timed versions."""
    net = Net(n, netns=False)
    port, announce, learner_port = free_ports(3)
    learner = LearnerSide(str(base / f"learner-{n}"), net.source, learner_port, keep=2, shard_bytes=1 << 30,
                          checksum=checksum)
    common = relay_overrides(net, port, announce, learner_port, "weights.keep=2", "relay.linger_s=0.5",
                             f"relay.window={window}", f"relay.chunk_bytes={chunk_mb << 20}", "run.log_level=WARNING")
    logs = base / "logs"
    logs.mkdir(exist_ok=True)
    procs = [start([], [*common, f"weights.root={learner.root}", "--serve"], logs / f"source-{n}.log")]
    procs += [start([], [*common, f"weights.root={base / f'node{n}-{i}'}", "--index", str(i)],
                    logs / f"relay-{n}-{i}.log") for i in range(n)]
    out, cpu0 = [], []
    try:
        wait_ready([net.source, *net.hosts], port)
        seen = Announcements(net.hosts, announce)
        time.sleep(0.3)
        for v in range(repeat + 1):
            if v:
                raw = raw_transfer(Path(published.path), "127.0.0.2", free_ports(1)[0], base)
            if v == 1:
                cpu0 = [cpu_seconds(p.pid) for p in procs]
            published = learner.write(v, mb)
            nbytes = sum(f.stat().st_size for f in Path(published.path).glob("*.safetensors"))
            t0 = time.monotonic()
            learner.announce_version(published)
            seen.wait(list(range(n)), v, timeout=600)
            if v:
                out.append((time.monotonic() - t0, raw, nbytes))
        gb = sum(b for _, _, b in out) / 1e9
        used = [cpu_seconds(p.pid) - c for p, c in zip(procs, cpu0)]
        cpu = {"source": used[0] / gb, "relay": statistics.mean(used[1:]) / gb}
        seen.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        learner.close()
    return out, cpu


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-receiver":
        raw_receiver(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=512, help="MB per weight version")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4], help="chain lengths to measure")
    p.add_argument("--repeat", type=int, default=3, help="timed versions per chain length (after one warm-up)")
    p.add_argument("--window", type=int, default=8, help="relay.window")
    p.add_argument("--chunk-mb", type=int, default=4, help="relay.chunk_bytes in MiB")
    p.add_argument("--checksum", choices=["sha256", "none"], default="sha256",
                   help="the learner's weights.checksum: sha256 (each file hashed whole on every node) or none "
                        "(each chunk checked against the source's CRC-32; the default from a GPU)")
    args = p.parse_args()
    base = Path("/dev/shm") / f"offpolicy-bench-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    load = os.getloadavg()[0]
    try:
        rows = [(n, rounds(n, args.mb, args.repeat, base, args.window, args.chunk_mb, args.checksum))
                for n in args.nodes]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{args.mb:g} MB per version, learner checksum {args.checksum}, relay.window={args.window}, "
          f"relay.chunk_bytes={args.chunk_mb} MiB; "
          f"{args.repeat} timed versions per row, median (best); {os.cpu_count()} CPUs, load average "
          f"{load:.1f} before and {os.getloadavg()[0]:.1f} after\n")
    print("| nodes | relay s to the last node | relay MB/s | raw ZeroMQ s | raw MB/s | ratio relay/raw | "
          "MB/s delivered to all nodes | CPU s per GB: source ; each relay |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, (got, cpu) in rows:
        nbytes = got[0][2]
        relay, raw = [r for r, _, _ in got], [w for _, w, _ in got]
        ratio = statistics.median(w / r for r, w, _ in got)
        mbs = lambda t: f"{nbytes / 1e6 / statistics.median(t):.0f} ({nbytes / 1e6 / min(t):.0f})"  # noqa: E731
        print(f"| {n} | {statistics.median(relay):.2f} ({min(relay):.2f}) | {mbs(relay)} | "
              f"{statistics.median(raw):.2f} ({min(raw):.2f}) | {mbs(raw)} | {ratio:.2f} ({min(raw) / min(relay):.2f}) "
              f"| {n * nbytes / 1e6 / statistics.median(relay):.0f} | {cpu['source']:.2f} ; {cpu['relay']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
