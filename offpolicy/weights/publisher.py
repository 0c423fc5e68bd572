"""The learner's weight publisher: each version in the native format and every `weights.formats` one.

`Publisher.publish(version, weights, hf_config)` takes the backend's (HF name, tensor) pairs once (one
gather on a Megatron learner), writes the native version (what checkpoints export and the learner's
own reference), then for each low-bit format quantizes the same tensors where they are (the learner's
GPU) and writes that format's version into its own store (`formats.store_run`). Only after every
format is written does the caller announce the version, so a rollout that hears of version N finds it
in whichever format it reads. Invariants: each format's store keeps its newest `weights.keep` versions
under the same reader-flock rule; `drop_after` (a resumed learner's abandoned future) acts on every
format; a version some format already holds (a resumed learner) is not written there again.

`begin(version, backend, overlap)` is the learner's entry: it returns a `Publishing` as soon as the
weights are snapshotted, and the writing goes on in a background thread (`wait()` joins it and returns
the native `Published`; the version exists only then). A backend with `publish` (Megatron) writes its
shards from every rank itself (weights/sharded.py); any other is snapshotted (its tensors cloned, unless
`overlap` is off and the caller waits at once) and written here through `publish`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from offpolicy.weights.formats import NATIVE, encode, store_run
from offpolicy.weights.store import MANIFEST, Published, WeightStore, list_versions, read_manifest, version_dir

if TYPE_CHECKING:
    import torch

    from offpolicy.config import WeightsConfig


class FormatPublished(msgspec.Struct):
    fmt: str
    total_bytes: int
    seconds: float  # quantize + write
    quantize_seconds: float
    committed: float = 0.0  # wall time just before it was renamed into place (Published.committed); 0 = held already


class Publisher:
    def __init__(self, w: WeightsConfig, run: str, native_at: Callable[[int], bool] = lambda version: True):
        """`native_at(version)`: whether `version` is written in the native format too (weights.native=checkpoints:
        only the versions a checkpoint exports; the learner loop says which)."""
        self.w, self.run, self.native_at = w, run, native_at

        def store(fmt: str) -> WeightStore:
            return WeightStore(w.root, store_run(run, fmt), keep=w.keep, shard_bytes=w.shard_bytes,
                               checksum=w.checksum, reuse_files=w.reuse_files, register_maps=w.register_maps, fmt=fmt,
                               gap_bytes=w.publish_gap_mib << 20)

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
        missing = self.missing(version)
        named = list(weights()) if missing else []
        self.last = []
        for fmt, store in self.stores.items():
            if fmt not in missing:
                self.last += self._held(version, [], [fmt])
                continue
            t1 = time.perf_counter()
            tensors, config = encode(fmt, named, hf_config, self.w.fp8_block_size, self.w.fp8_skip)
            _sync(tensors)
            t2 = time.perf_counter()
            p = store.publish(version, tensors, config)
            self.last.append(FormatPublished(fmt=fmt, total_bytes=p.total_bytes, seconds=time.perf_counter() - t1,
                                             quantize_seconds=t2 - t1, committed=p.committed))
        return self._published(version, time.perf_counter() - t0 if missing else 0.0)

    def missing(self, version: int) -> list[str]:
        """Formats whose store does not hold `version` yet and should (native only where `native_at`)."""
        return [fmt for fmt in self.stores if (fmt != NATIVE or self.native_at(version))
                and version not in list_versions(self.w.root, store_run(self.run, fmt))]

    def _published(self, version: int, seconds: float) -> Published:
        """The version as announced: the native one's path and size, or the first format's where native was left
        out (weights.native=checkpoints)."""
        first = next((f for f in self.last if f.total_bytes), self.last[0])
        committed = min((f.committed for f in self.last if f.committed), default=0.0)  # the first format readable
        return Published(version=version, path=str(version_dir(self.w.root, store_run(self.run, first.fmt), version)),
                         total_bytes=first.total_bytes, seconds=seconds, committed=committed)

    def begin(self, version: int, backend, overlap: bool = True) -> Publishing:
        """Snapshot the backend's weights for `version` and write them in the background (module doc)."""
        t0 = time.perf_counter()
        missing = self.missing(version)
        out = Publishing(version)
        if not missing:
            self.last = self._held(version, [])
            out.result = self._published(version, 0.0)
        elif (pending := backend.publish(version, missing, self.w, self.run)) is not None:  # every rank's shards
            out.snapshot_seconds = time.perf_counter() - t0

            def finish() -> Published:
                written = pending.wait()
                self.last = self._held(version, missing)
                for fmt, p in written.items():
                    self.last[[f.fmt for f in self.last].index(fmt)] = FormatPublished(
                        fmt=fmt, total_bytes=p.total_bytes, seconds=p.seconds, quantize_seconds=pending.snapshot_seconds,
                        committed=p.committed)
                return msgspec.structs.replace(self._published(version, time.perf_counter() - t0),
                                               phases=list(pending.phases), fresh_files=pending.fresh_files,
                                               staged_files=pending.staged_files)

            out.start(finish)
        else:
            named = [(n, t.detach().clone() if overlap else t) for n, t in backend.weights()]  # the snapshot
            out.snapshot_seconds = time.perf_counter() - t0
            hf_config = backend.hf_config()
            out.start(lambda: self.publish(version, lambda: named, hf_config))
        return out

    def _held(self, version: int, missing: list[str], fmts: list[str] | None = None) -> list[FormatPublished]:
        """Per format (of `fmts`, default all): the stored version's size; 0 for formats in `missing` (the caller
        fills them in) and for a native version left out (weights.native=checkpoints)."""
        out = []
        for fmt in self.stores if fmts is None else fmts:
            d = version_dir(self.w.root, store_run(self.run, fmt), version)
            total = 0 if fmt in missing or not (d / MANIFEST).exists() else read_manifest(d).total_bytes
            out.append(FormatPublished(fmt=fmt, total_bytes=total, seconds=0.0, quantize_seconds=0.0))
        return out

    def drop_after(self, version: int) -> list[int]:
        """Remove versions newer than `version` in every format; returns the native ones removed."""
        dropped = self.native.drop_after(version)
        for fmt, store in self.stores.items():
            if fmt != NATIVE:
                store.drop_after(version)
        return dropped


class Publishing:
    """A version on its way into the store (`Publisher.begin`): `wait()` -> the native `Published`
    (raises what stopped it); `snapshot_seconds` is what the learner waited before training on."""

    def __init__(self, version: int):
        self.version, self.snapshot_seconds = version, 0.0
        self.result: Published | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, work: Callable[[], Published]) -> None:
        def run() -> None:
            try:
                self.result = work()
            except BaseException as e:  # handed to whoever waits
                self.error = e

        self._thread = threading.Thread(target=run, name=f"publish-v{self.version}", daemon=True)
        self._thread.start()

    def wait(self) -> Published:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def _sync(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Wait for the quantizing kernels, so that their time is counted as quantization, not as the write."""
    import torch

    for device in {t.device for _, t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)
