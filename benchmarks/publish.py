"""Timing the sharded publish inside a Megatron learner (benchmarks/megatron_layouts.py --publish N).

`measure(backend, versions, train, cuda)` runs on rank 0 (the other ranks follow in `serve`), after the
layout's timed train steps, into a fresh store in /dev/shm with the learner's GPU settings (reuse_files,
register_maps, checksum none: `fastpath.resolve`), in the native format, or in `weights.formats` alone when the
layout sets them (`--set weights.formats=[mxfp4]`: each rank quantizes its own shards):
- `fresh_s`: the first keep + 1 versions, published alone and waited for. Their files are new pages of
  shared memory (the store has nothing to recycle yet): what the first versions of a run cost.
- warm-up: keep + 1 more versions, into the files of collected ones, met again for the first time, so each
  is mapped and page-locked once (`weights/maps.py`); not timed.
- `publish_s`: the next `versions` versions alone and waited for (snapshot, every rank's writes, rank 0's
  commit): the steady state, which every later version of a run pays; `publish_stages` is rank 0's
  `weights.profile` of them (seconds per stage, summed over the versions; `publish.`/`write.` keys as
  `offpolicy bench weights` prints them) and its path counts (`files.direct`: through registered maps);
- `host_copy_gbps`: a multithreaded host memory copy of the version's size in the same run
  (`transfer.copy_bytes`, the store's own copier), the bound the publish is held against;
- `stall_s`: `versions` steps trained with publishing overlapped as the learner does it
  (`weights.overlap_publish`): per version the time the learner waits (the previous version's writes to
  end, then the snapshot) before its next step; `stall_pct` = stall / train step (the layout's step
  time, measured without a publish in flight); `overlap_step_s` is the mean train step while a version
  is being written, `slowdown_pct` how much slower that is than `control_step_s`, the mean of as many steps
  trained just before with nothing in flight (the same phase of the run: clocks, caches and allocator as warm);
  `slowdown_vs_layout_pct` is against the layout's own timed step instead (the figure before the control). The
  writes share the GPU's memory bandwidth, the host's and the CPU with the step.
- `PUBLISH_TRACE=DIR` (environment; rank 0): one step alone and one step with a version being written, each
  under torch's profiler: DIR/publish-FMT-{alone,writing}.json.gz (chrome traces: Perfetto) and .txt (ops by
  device time): where the slowdown goes (copy engines or kernels, host threads, waits).
"""

from __future__ import annotations

import os
import shutil
import time

import msgspec
import torch

from offpolicy.weights import fastpath


def host_copy_gbps(nbytes: int, repeats: int = 3) -> float:
    from offpolicy.weights.transfer import copy_bytes

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_bytes([(src, dst)])  # first touch of the pages
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        copy_bytes([(src, dst)])
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def measure(backend, versions: int, train, cuda: bool, step_s: float | None = None) -> dict:
    """`train()` runs one train step, `step_s` is the layout's step without publishing; returns the
    figures of the module doc."""
    from offpolicy.weights.profile import profile

    run = f"bench-publish-{os.getpid()}"
    w = fastpath.resolve(msgspec.structs.replace(backend.cfg.weights, root="/dev/shm/offpolicy-bench"), gpu=cuda)
    cycle = w.keep + 1  # file sets the store rotates through once it recycles

    fmts = list(w.formats) or ["native"]  # weights.formats=[mxfp4]: the low-bit version alone

    def publish(v: int) -> tuple[float, int]:
        t = time.perf_counter()
        got = backend.publish(v, fmts, w, run).wait()
        return time.perf_counter() - t, got[fmts[0]].total_bytes

    try:
        fresh = [publish(v)[0] for v in range(cycle)]
        warm = [publish(v)[0] for v in range(cycle, 2 * cycle)]
        v0 = 2 * cycle
        with profile() as prof:
            timed = [publish(v) for v in range(v0, v0 + versions)]
        times, total = [t for t, _ in timed], timed[-1][1]
        publish_s = sum(times) / len(times)
        control = []
        for _ in range(versions):  # the step alone, in this phase of the run
            t = time.perf_counter()
            train()
            control.append(time.perf_counter() - t)
        stalls, steps = [], []
        for v in range(v0 + versions, v0 + 2 * versions):
            t = time.perf_counter()
            train()  # the previous version is still being written (the first: none yet)
            steps.append(time.perf_counter() - t)
            t = time.perf_counter()
            pending = backend.publish(v, fmts, w, run)  # waits for the previous version's writes first
            stalls.append(time.perf_counter() - t)
        pending.wait()
        if os.environ.get("PUBLISH_TRACE"):
            _traces(os.environ["PUBLISH_TRACE"], fmts[0], train, lambda: backend.publish(v0 + 2 * versions, fmts, w, run))
        overlap = steps[1:] or steps  # the first step ran with nothing in flight
        stall_s, overlap_s = sum(stalls) / len(stalls), sum(overlap) / len(overlap)
        base = step_s or overlap_s
        control_s = sum(control) / len(control)
        copy = host_copy_gbps(total)
        return dict(publish_s=publish_s, publish_times=times, fresh_s=sum(fresh) / len(fresh), fresh_times=fresh,
                    warmup_times=warm, publish_stages={k: round(v, 4) for k, v in sorted(prof.seconds.items())},
                    publish_counts=dict(prof.counts), version_bytes=total, publish_gbps=total / publish_s / 1e9,
                    host_copy_gbps=copy, publish_vs_copy=total / publish_s / 1e9 / copy, stall_s=stall_s,
                    stall_times=stalls, overlap_step_s=overlap_s, stall_pct=100 * stall_s / base,
                    control_step_s=control_s, control_times=control, slowdown_pct=100 * (overlap_s / control_s - 1),
                    slowdown_vs_layout_pct=100 * (overlap_s / base - 1))
    finally:
        shutil.rmtree(f"{w.root}/{run}", ignore_errors=True)


def _traces(out: str, fmt: str, train, publish) -> None:
    """A train step alone, then one with `publish()`'s version being written, each profiled (module doc)."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out, exist_ok=True)
    cuda = torch.cuda.is_available()
    for name in ("alone", "writing"):
        pending = publish() if name == "writing" else None
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            train()  # synchronizes (megatron_layouts' train)
        if pending is not None:
            pending.wait()
        base = os.path.join(out, f"publish-{fmt}-{name}")
        prof.export_chrome_trace(base + ".json")
        with open(base + ".json", "rb") as f, gzip.open(base + ".json.gz", "wb") as g:
            g.write(f.read())
        os.unlink(base + ".json")
        with open(base + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                              row_limit=40, max_name_column_width=80))
