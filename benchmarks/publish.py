"""Timing the sharded publish inside a Megatron learner (benchmarks/megatron_layouts.py --publish N).

`measure(backend, steps, train)` runs on rank 0 (the other ranks follow in `serve`), after the layout's
timed train steps:
- `publish_s`: each of `versions` versions published alone and waited for (snapshot, every rank's
  writes, rank 0's commit), into a fresh store in /dev/shm with the learner's GPU settings (reuse_files,
  register_maps, checksum none: `fastpath.resolve`), the first (fresh pages, first plan) left out;
- `host_copy_gbps`: a multithreaded host memory copy of the version's size in the same run
  (`transfer.copy_bytes`, the store's own copier), the bound the publish is held against;
- `stall_s`: steps trained with publishing overlapped as the learner does it (`weights.overlap_publish`):
  per version the time the learner waits (the previous version's writes to end, then the snapshot)
  before its next step; `stall_pct` = stall / train step.
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


def measure(backend, versions: int, train, cuda: bool) -> dict:
    """`train()` runs one train step; returns the figures of the module doc."""
    run = f"bench-publish-{os.getpid()}"
    w = fastpath.resolve(msgspec.structs.replace(backend.cfg.weights, root="/dev/shm/offpolicy-bench"), gpu=cuda)
    times, total = [], 0
    try:
        for v in range(versions + 1):
            t = time.perf_counter()
            got = backend.publish(v, ["native"], w, run).wait()
            times.append(time.perf_counter() - t)
            total = got["native"].total_bytes
        timed = times[1:] or times
        publish_s = sum(timed) / len(timed)
        stalls, steps = [], []
        for v in range(versions + 1, 2 * versions + 1):
            t = time.perf_counter()
            train()
            steps.append(time.perf_counter() - t)
            t = time.perf_counter()
            pending = backend.publish(v, ["native"], w, run)  # waits for the previous version's writes first
            stalls.append(time.perf_counter() - t)
        pending.wait()
        stall_s, step_s = sum(stalls) / len(stalls), sum(steps) / len(steps)
        copy = host_copy_gbps(total)
        return dict(publish_s=publish_s, publish_times=times, version_bytes=total, publish_gbps=total / publish_s / 1e9,
                    host_copy_gbps=copy, publish_vs_copy=total / publish_s / 1e9 / copy, stall_s=stall_s,
                    stall_times=stalls, overlap_step_s=step_s, stall_pct=100 * stall_s / step_s)
    finally:
        shutil.rmtree(f"{w.root}/{run}", ignore_errors=True)
