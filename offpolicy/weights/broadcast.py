"""The learner's weight broadcaster: each version in the native format and every `weights.formats` one.

`Broadcaster.publish(version, weights, hf_config)` takes the backend's (HF name, tensor) pairs once (one
gather on a Megatron learner), writes the native version (what checkpoints export and the learner's
own reference), then for each low-bit format quantizes the same tensors where they are (the learner's
GPU) and writes that format's version into its own store (`formats.store_run`). Only after every
format is written does the caller announce the version, so a rollout that hears of version N finds it
in whichever format it reads. Invariants: each format's store keeps its newest `weights.keep` versions
under the same reader-flock rule; `drop_after` (a resumed learner's abandoned future) acts on every
format; a version some format already holds (a resumed learner) is not written there again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from offpolicy.weights.formats import NATIVE, encode, store_run
from offpolicy.weights.store import Published, WeightStore, list_versions, read_manifest, version_dir

if TYPE_CHECKING:
    import torch

    from offpolicy.config import WeightsConfig


class FormatPublished(msgspec.Struct):
    fmt: str
    total_bytes: int
    seconds: float  # quantize + write
    quantize_seconds: float


class Broadcaster:
    def __init__(self, w: WeightsConfig, run: str):
        self.w, self.run = w, run

        def store(fmt: str) -> WeightStore:
            return WeightStore(w.root, store_run(run, fmt), keep=w.keep, shard_bytes=w.shard_bytes,
                               checksum=w.checksum, reuse_files=w.reuse_files, register_maps=w.register_maps, fmt=fmt)

        self.stores = {fmt: store(fmt) for fmt in (NATIVE, *w.formats)}
        self.last: list[FormatPublished] = []  # per format, of the last publish

    @property
    def native(self) -> WeightStore:
        return self.stores[NATIVE]

    def publish(self, version: int, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                hf_config: dict) -> Published:
        """Write `version` in every format that does not hold it yet (a resumed learner finds some written);
        `weights()` is called once, only if one is missing. Returns the native version's `Published`, its
        `seconds` over all formats written now (0 when none was)."""
        t0 = time.perf_counter()
        missing = [fmt for fmt in self.stores if version not in list_versions(self.w.root, store_run(self.run, fmt))]
        named = list(weights()) if missing else []
        self.last = []
        for fmt, store in self.stores.items():
            if fmt not in missing:
                m = read_manifest(version_dir(self.w.root, store_run(self.run, fmt), version))
                self.last.append(FormatPublished(fmt=fmt, total_bytes=m.total_bytes, seconds=0.0, quantize_seconds=0.0))
                continue
            t1 = time.perf_counter()
            tensors, config = encode(fmt, named, hf_config, self.w.fp8_block_size, self.w.fp8_skip)
            _sync(tensors)
            t2 = time.perf_counter()
            p = store.publish(version, tensors, config)
            self.last.append(FormatPublished(fmt=fmt, total_bytes=p.total_bytes, seconds=time.perf_counter() - t1,
                                             quantize_seconds=t2 - t1))
        return Published(version=version, path=str(version_dir(self.w.root, self.run, version)),
                         total_bytes=self.last[0].total_bytes, seconds=time.perf_counter() - t0 if missing else 0.0)

    def drop_after(self, version: int) -> list[int]:
        """Remove versions newer than `version` in every format; returns the native ones removed."""
        dropped = self.native.drop_after(version)
        for fmt, store in self.stores.items():
            if fmt != NATIVE:
                store.drop_after(version)
        return dropped


def _sync(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Wait for the quantizing kernels, so that their time is counted as quantization, not as the write."""
    import torch

    for device in {t.device for _, t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)
