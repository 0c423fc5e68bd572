"""Probe of issue 48: does a version written in the background slow the learner's launch thread?

A GPU learner's main thread launches kernels: many short Python calls and tiny torch ops. While a
version is written (`weights.overlap_publish`), the publish's threads run beside it in the same process;
whenever one of them holds Python's GIL, the launch thread stops (and the GPU, fed by it, idles). This
probe runs such a launch loop in the main thread (`Launch`: each iteration 24 tiny torch ops and Python
bookkeeping, timed) in windows, interleaved in one run:

- `alone`: nothing else in the process;
- `publish` (or `gap N`, one row per `--gaps` value): the real sharded publish (`ShardWriter.begin`, its writer
  thread and `transfer.write_files`' pool, exactly as a learner rank runs it) writes a version of `--gb` GB of
  bf16 tensors into /dev/shm; the window lasts until the version is committed. The steady state: recycled
  files (`reuse_files`); `--maps` (CPU) writes them through maps as a GPU learner does (`weights/maps.py`;
  here a host map cache, so the CPU copies with `np.copyto` where a GPU's copy engine would move the bytes);
- `burn` (control): as many threads as the publish's pool copying memory in C with the GIL released
  (`np.copyto` of 32 MiB blocks) for as long as the last publish window: the same CPU load, no Python;
- `hog` (control): one thread running pure Python: what holding the GIL looks like here.

Per window: iterations' p50 / p99 / max latency and mean, and where the main thread's wall time went
(`/proc/thread-self/schedstat`, `status`): on a CPU (`cpu ms/s`), waiting in a run queue (`queue ms/s`: other
threads, other processes), or asleep (`gil ms/s`, `gil ms` per window: wall - cpu - queue; in this loop the
only reason to sleep is waiting for the GIL, but on a VM it also holds the hypervisor's steal, so `sleeps`, how
often the thread blocked, is the clean sign: 0 = no GIL wait at all). `ratio` is the mean iteration over the
mean alone (medians over repeats); on a small machine it also carries the CPU the writers take: compare `burn`.

`--device cuda` (a GPU): the tensors on the GPU, written through real page-locked maps, and the launch loop's
ops on the GPU with an `.item()` every `--sync-every` iterations (a device -> host copy and a wait, as a MoE
dispatcher's split sizes or a logged loss), each timed (`sync p50 ms`, `sync max ms`). With `--gaps 0 32` it
shows whether such a small copy waits behind the version's copies in the copy engine (`weights/gaps.py`):
`sync max ms` near the publish's time at gap 0, under a millisecond with gaps.

Attribution (`--trace`): the writer's stages (`weights.profile` traced) and phases with their intervals, and
every launch iteration longer than `--stall-ms`; each stall is charged to the stages that overlap it.

    python benchmarks/publish_gil.py --gb 2 --repeats 7            # CPU, recycled files, staged
    python benchmarks/publish_gil.py --gb 2 --repeats 7 --maps     # CPU, through maps
    python benchmarks/publish_gil.py --device cuda --gb 5 --gaps 0 32   # a GPU: the copy engine's queue
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import numpy as np
import torch

torch.set_num_threads(1)  # the launch loop's tiny ops stay on its own thread


def pieces(gb: float, hidden: int = 2048) -> list[tuple[str, None, torch.Tensor, tuple]]:
    """bf16 tensors of a Llama-like model of about `gb` GB: per layer 4 h x h, 3 h x 4h, 2 norms (small)."""
    per_layer = (4 * hidden * hidden + 3 * 4 * hidden * hidden + 2 * hidden) * 2
    layers = max(1, int(gb * 1e9 / per_layer))
    out = []

    def add(name: str, *shape: int) -> None:
        out.append((name, None, torch.full(shape, float(len(out) % 7 + 1), dtype=torch.bfloat16), (len(out),)))

    for i in range(layers):
        p = f"model.layers.{i}."
        for m in "qkvo":
            add(p + f"self_attn.{m}_proj.weight", hidden, hidden)
        add(p + "mlp.gate_proj.weight", 4 * hidden, hidden)
        add(p + "mlp.up_proj.weight", 4 * hidden, hidden)
        add(p + "mlp.down_proj.weight", hidden, 4 * hidden)
        add(p + "input_layernorm.weight", hidden)
        add(p + "post_attention_layernorm.weight", hidden)
    add("model.norm.weight", hidden)
    return out


class Launch:
    """What a learner's host thread does between kernels: Python calls and tiny torch ops; on a GPU also, every
    `sync_every` iterations, an `.item()` (a device -> host copy and a wait, as a MoE dispatcher's split sizes or
    a loss), each timed into `syncs` (ns)."""

    def __init__(self, ops: int = 24, device: str = "cpu", sync_every: int = 0):
        self.ops, self.sync_every, self.n = ops, sync_every, 0
        self.x = torch.ones(64, device=device)
        self.w = torch.full((64,), 0.5, device=device)
        self.meta = {"layer": 0, "shape": (64,)}
        self.syncs: list[int] = []

    def iteration(self) -> None:
        y = self.x
        for i in range(self.ops):
            self.meta["layer"] = i  # module bookkeeping
            y = torch.add(y, self.w, alpha=0.5) if i % 2 else y.mul(self.w)
        self.x = y.clamp_(-1.0, 1.0)
        self.n += 1
        if self.sync_every and self.n % self.sync_every == 0:
            t = time.perf_counter_ns()
            self.x[0].item()
            self.syncs.append(time.perf_counter_ns() - t)


def _schedstat() -> tuple[int, int, int]:
    """This thread's ns on a CPU, ns waiting in a run queue, and how often it went to sleep (blocked)."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, queued, _ = f.read().split()
    with open("/proc/thread-self/status") as f:
        sleeps = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return int(on_cpu), int(queued), sleeps


def window(launch: Launch, done, stall_ns: int) -> dict:
    """Run launch iterations until `done()`; their latencies and where the thread's time went."""
    lat, stalls = [], []
    launch.syncs = []
    c0, q0, s0 = _schedstat()
    t0 = t = time.perf_counter_ns()
    while not done():
        launch.iteration()
        now = time.perf_counter_ns()
        lat.append(now - t)
        if now - t > stall_ns:
            stalls.append((t, now))
        t = now
    wall = t - t0
    c1, q1, s1 = _schedstat()
    cpu, queued = c1 - c0, q1 - q0
    lat.sort()
    n = len(lat)
    return dict(iterations=n, wall_s=wall / 1e9, mean_us=wall / max(n, 1) / 1e3, p50_us=lat[n // 2] / 1e3,
                p99_us=lat[min(n - 1, n * 99 // 100)] / 1e3, max_ms=lat[-1] / 1e6,
                cpu_ms_s=cpu / wall * 1e3, queue_ms_s=queued / wall * 1e3,
                gil_ms_s=max(0, wall - cpu - queued) / wall * 1e3, gil_ms=max(0, wall - cpu - queued) / 1e6,
                sleeps=s1 - s0, stalls=stalls, **_syncs(launch.syncs))


def _syncs(ns: list[int]) -> dict:
    if not ns:
        return {}
    ns = sorted(ns)
    return dict(syncs=len(ns), sync_p50_ms=ns[len(ns) // 2] / 1e6, sync_max_ms=ns[-1] / 1e6)


def _until(seconds: float):
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= end


def burner(threads: int, seconds: float):
    """Threads copying 32 MiB blocks in C (the GIL released) for `seconds`; returns `done()`."""
    src = np.ones(32 << 20, dtype=np.uint8)
    dsts = [np.empty_like(src) for _ in range(threads)]
    stop = threading.Event()

    def run(dst):
        while not stop.is_set():
            np.copyto(dst, src)

    pool = [threading.Thread(target=run, args=(d,), daemon=True) for d in dsts]
    for p in pool:
        p.start()
    end = time.perf_counter() + seconds

    def done():
        if time.perf_counter() < end:
            return False
        stop.set()
        return True
    return done, pool


def hog(seconds: float):
    """One thread running pure Python (holding the GIL but for the interpreter's switches) for `seconds`."""
    end = time.perf_counter() + seconds

    def run():
        while time.perf_counter() < end:
            sum(range(2000))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return (lambda: not t.is_alive()), [t]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="version size (bf16 tensors)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the tensors and the launch loop's ops live (cuda: real page-locked maps)")
    ap.add_argument("--threads", type=int, default=0, help="the publish's copy threads (0: transfer.THREADS)")
    ap.add_argument("--checksum", default="none", choices=["none", "sha256"])
    ap.add_argument("--maps", action="store_true", help="CPU: write through (host) maps of recycled files")
    ap.add_argument("--fresh", action="store_true", help="fresh files every version (no reuse_files)")
    ap.add_argument("--gaps", type=int, nargs="+", default=None,
                    help="weights.publish_gap_mib values, a publish row each (default: the config's)")
    ap.add_argument("--sync-every", type=int, default=10, help="cuda: an .item() every N launch iterations")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (0: default)")
    ap.add_argument("--stall-ms", type=float, default=2.0)
    ap.add_argument("--trace", action="store_true", help="charge stalls to the writer's stages")
    ap.add_argument("--root", default="/dev/shm")
    ap.add_argument("--json", default="", help="write the rows here too")
    args = ap.parse_args(argv)

    import msgspec

    from offpolicy.config import WeightsConfig
    from offpolicy.weights import profile as profile_mod
    from offpolicy.weights import transfer
    from offpolicy.weights.sharded import ShardWriter

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.threads:
        transfer.THREADS = args.threads
    cuda = args.device == "cuda"
    root = os.path.join(args.root, f"offpolicy-gilprobe-{os.getpid()}")
    w = WeightsConfig(root=root, keep=1, checksum=args.checksum, reuse_files=not args.fresh,
                      register_maps=(cuda or args.maps) and not args.fresh)
    gaps = args.gaps if args.gaps is not None else [getattr(w, "publish_gap_mib", 0)]
    named = [(n, r, t.to(args.device), o) for n, r, t, o in pieces(args.gb)]
    total = sum(t.numel() * t.element_size() for _, _, t, _ in named)
    writer = ShardWriter(w, "probe", rank=0, world=1)
    if args.maps and not cuda and not args.fresh:
        from offpolicy.weights.maps import MapCache

        writer.maps = MapCache(w.keep + 2, register=lambda *a: None, unregister=lambda *a: None, host=True)
    launch = Launch(device=args.device, sync_every=args.sync_every if cuda else 0)
    stall_ns = int(args.stall_ms * 1e6)
    version = 0

    def publish(gap: int | None = None):
        nonlocal version
        version += 1
        if gap is not None:
            writer.w = msgspec.structs.replace(w, publish_gap_mib=gap)
        return writer.begin(version, ["native"], named, {"model_type": "llama"})

    names = {g: "publish" if len(gaps) == 1 else f"gap {g}" for g in gaps}
    try:
        for _ in range(2 * (w.keep + 2)):  # steady state: recycled files (met again: mapped)
            publish().wait()
        for _ in range(200):
            launch.iteration()
        rows: dict[str, list[dict]] = {"alone": [], **{n: [] for n in names.values()}, "burn": [], "hog": []}
        publish_alone, charged = [], {}
        last = 1.0
        for _ in range(args.repeats):
            t = time.perf_counter()
            publish().wait()
            publish_alone.append(time.perf_counter() - t)
            rows["alone"].append(window(launch, _until(last), stall_ns))
            for gap, name in names.items():
                t0 = time.perf_counter()
                with (profile_mod.profile(trace=True) if args.trace else profile_mod.profile()) as prof:
                    pending = publish(gap if len(gaps) > 1 or args.gaps is not None else None)
                    began = time.perf_counter() - t0
                    row = window(launch, lambda: pending.done, stall_ns)
                    pending.wait()
                row["publish_s"] = last = time.perf_counter() - t0
                row["begin_ms"] = began * 1e3
                row["counts"] = dict(prof.counts)
                rows[name].append(row)
                if args.trace:
                    _charge(charged, row["stalls"], prof.events + _phases(pending))
            for name, control in (("burn", lambda s: burner(transfer.THREADS, s)), ("hog", hog)):
                done, pool = control(min(last, 0.5) if name == "hog" else last)
                rows[name].append(window(launch, done, stall_ns))
                for p in pool:
                    p.join()
        report(args, total, rows, publish_alone, charged)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _phases(pending) -> list[tuple[str, str, int, int]]:
    """The writer thread's phases (`sharded.Pending.phases`, wall clock) as profile events (perf_counter_ns)."""
    shift = time.perf_counter_ns() - time.time_ns()
    return [("phase." + name, "writer", int(start * 1e9) + shift, int((start + s) * 1e9) + shift)
            for name, start, s in pending.phases]


def _charge(charged: dict, stalls: list, events: list) -> None:
    """Add each stall's overlap with each writer stage (all threads) to `charged[stage]` (ms)."""
    for a, b in stalls:
        for key, _, s, e in events:
            overlap = min(b, e) - max(a, s)
            if overlap > 0:
                charged[key] = charged.get(key, 0.0) + overlap / 1e6


def report(args, total: int, rows: dict, publish_alone: list, charged: dict) -> None:
    from offpolicy.weights import transfer

    med = statistics.median
    alone = med(r["mean_us"] for r in rows["alone"])
    path = "fresh files" if args.fresh else "maps" if args.maps or args.device == "cuda" else "recycled files, staged"
    print(f"version {total / 1e9:.2f} GB bf16 on {args.device}, {args.repeats} repeats, copy threads {transfer.THREADS}, "
          f"checksum {args.checksum}, {path}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    published = [n for n in rows if n not in ("alone", "burn", "hog")]
    print(f"publish alone {med(publish_alone):.3f} s (median), while launching "
          + ", ".join(f"{med(r['publish_s'] for r in rows[n]):.3f} s ({n})" for n in published))
    cols = [("iterations", "iters", 0), ("mean_us", "mean us", 1), ("p50_us", "p50 us", 1), ("p99_us", "p99 us", 1),
            ("max_ms", "max ms", 2), ("cpu_ms_s", "cpu ms/s", 0), ("queue_ms_s", "queue ms/s", 0),
            ("gil_ms_s", "gil ms/s", 1), ("gil_ms", "gil ms", 1), ("sleeps", "sleeps", 0)]
    if args.device == "cuda":
        cols += [("sync_p50_ms", "sync p50 ms", 3), ("sync_max_ms", "sync max ms", 2)]
    print(f"{'window':8} " + " ".join(f"{h:>{max(7, len(h))}}" for _, h, _ in cols) + f" {'ratio':>6}")
    out = {"args": vars(args), "bytes": total, "publish_alone_s": publish_alone, "rows": {}}
    for name, rs in rows.items():
        m = {k: med(r.get(k, 0.0) for r in rs) for k, _, _ in cols}
        ratio = m["mean_us"] / alone
        print(f"{name:8} " + " ".join(f"{m[k]:>{max(7, len(h))}.{d}f}" for k, h, d in cols) + f" {ratio:6.3f}")
        out["rows"][name] = {**m, "ratio": ratio, "each": [{k: v for k, v in r.items() if k != "stalls"} for r in rs]}
    if charged:
        print("stall time charged to writer stages (ms, over all publish windows; overlapping stages both count):")
        for key, ms in sorted(charged.items(), key=lambda kv: -kv[1]):
            print(f"  {key:24} {ms:8.1f}")
        out["charged_ms"] = charged
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
