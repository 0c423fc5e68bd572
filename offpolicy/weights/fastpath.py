"""Which write path the learner's weight store takes: `auto` settings resolved to concrete ones.

`weights.reuse_files` and `weights.checksum` default to `auto`; the learner resolves them once it
knows where its weights live (`resolve(w, gpu)`), and every consumer of the config then sees plain
values. The rule is the fast path wherever it is safe:

- `reuse_files: auto` is on when the learner publishes from a GPU: new versions are written into the
  shard files of collected ones, which `register_maps` (on by default) page-locks once, so the GPU
  copies a version straight into shared memory near a pinned copy's rate, against a small fraction
  of it for fresh files (measured: docs/weights.md, "The defaults"; docs/benchmarks.md, "Weights").
  The price is the subscribe API's contract: a reader must copy what it keeps before
  `WeightVersion.close()` (the rollout engines, the relay and the evaluator all do). On the CPU (the
  quickstart, the tests) it stays off, as before: publishes are small there and fresh files keep the
  old contract.
- `checksum: auto` is `sha256` when a rollout checks versions (`weights.verify`) or the learner
  publishes from the CPU (small versions; the old default), else `none`: the learner's threads
  would hash every byte on the publish's critical path, capping the publish's rate, and nobody
  needs it. Within a node the store is the learner's own writes, renamed into place whole; across
  nodes the relay checks every chunk against a CRC-32 computed by the source as it reads the
  learner's files (docs/weights.md, "Integrity": both, measured).

Pure and light (no torch), so configs resolve anywhere; `tests/unit/test_weights_fastpath.py`.
"""

from __future__ import annotations

import msgspec

from offpolicy.config import WeightsConfig


def resolve(w: WeightsConfig, gpu: bool) -> WeightsConfig:
    """`w` with `auto` replaced: `gpu` says whether the learner publishes from a GPU."""
    reuse = gpu if w.reuse_files == "auto" else bool(w.reuse_files)
    checksum = w.checksum
    if checksum == "auto":
        checksum = "sha256" if w.verify or not gpu else "none"
    return msgspec.structs.replace(w, reuse_files=reuse, checksum=checksum)

