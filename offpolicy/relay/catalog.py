"""What a node can serve: the complete versions in its store and the one it is receiving now.

The learner-side shard server's catalog is the learner's store (read only); a relay's is its own
store plus its `Incoming` version, which it offers as soon as the manifest is known, so the next node
starts pulling while this one still receives. Invariants: a complete version that is being served is
held like any reader holds it (a shared `flock` on its manifest, via `WeightVersion`), so the store's
collector (the learner's, or this relay's `WeightStore.collect`) leaves it in place until it has been
idle for `idle_s`; chunk replies are zero-copy views on read-only maps of the files. A node relaying
several weight formats (`relay.formats`) has one catalog per format, each over that format's store. A
stored version's file without a sha256 in its manifest gets the CRC-32 of every chunk served, computed once from the
served bytes (on the learner's node this is the source's read of the learner's file, the digest every
relay downstream checks against; docs/weights.md, "Integrity").

A learner on several nodes commits on each node only that node's part of a version (weights/sharded.py):
`<format's store>/node<k>/v<N>`, its files and the whole manifest. The source on learner node k has a
catalog over that part (`part=k`): it offers the part's versions with the whole manifest, and serves
only the files whose manifest entry names node k (`Stored.serves`); the relay assembles the version.
"""

from __future__ import annotations

import mmap
import time
import zlib

import numpy as np

from offpolicy.relay.incoming import Incoming
from offpolicy.weights.formats import NATIVE, part_run
from offpolicy.weights.store import MANIFEST, Manifest, list_versions, version_dir
from offpolicy.weights.version import WeightVersion


class Stored:
    """A complete version of the store, held while this node serves it."""

    def __init__(self, root: str, run: str, version: int, part: int | None = None):
        self.hold = WeightVersion(version_dir(root, run, version))  # FileNotFoundError if collected meanwhile
        self.version, self.part = version, part
        self.raw: bytes = (self.hold.path / MANIFEST).read_bytes()
        self.manifest: Manifest = self.hold.manifest
        self._maps: dict[str, mmap.mmap | None] = {}
        self._crcs: dict[tuple[str, int, int], int] = {}  # served chunks of files without a sha256
        self.last_used = time.monotonic()

    def have(self, name: str, offset: int, length: int) -> bool:
        return True

    def serves(self, name: str) -> bool:
        """Whether this node serves file `name` of the manifest: every file, or in a part only its node's."""
        return self.part is None or self.manifest.files[name].node == self.part

    def crc32(self, name: str, offset: int, length: int) -> int | None:
        """CRC-32 of these bytes for a file without a sha256 (computed on first request, then kept), else None."""
        if self.manifest.files[name].sha256:
            return None
        key = (name, offset, length)
        crc = self._crcs.get(key)
        if crc is None:
            crc = self._crcs[key] = zlib.crc32(self.view(name, offset, length))
        return crc

    def view(self, name: str, offset: int, length: int) -> np.ndarray:
        if name not in self._maps:
            size = self.manifest.files[name].bytes
            with open(self.hold.path / name, "rb") as f:
                self._maps[name] = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        mm = self._maps[name]
        if mm is None or length == 0:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(mm, dtype=np.uint8, count=length, offset=offset)

    def close(self) -> None:
        """Let the collector have it; maps still lent to ZeroMQ sends stay valid until those complete."""
        self._maps.clear()
        self.hold.close()


Entry = Stored | Incoming


class Catalog:
    def __init__(self, root: str, run: str, idle_s: float, fmt: str = NATIVE, part: int | None = None):
        self.fmt = fmt  # weight format: this catalog is the store of `store_run(run, fmt)`
        self.part = part  # learner node whose part this source serves (`<store>/node<k>`); None = whole versions
        self.root, self.run, self.idle_s = root, part_run(run, fmt, part), idle_s
        self.incoming: Incoming | None = None
        self.newest_heard = -1  # from the learner's announcements and upstream offers
        self.ended = False  # the run is over and this node holds everything it ever will
        self._held: dict[int, Stored] = {}

    def complete(self) -> list[int]:
        return list_versions(self.root, self.run)

    def newest(self) -> int:
        """Newest version this node has heard of or holds (-1 = none)."""
        versions = self.complete()
        return max(self.newest_heard, versions[-1] if versions else -1,
                   self.incoming.version if self.incoming else -1)

    def offer(self, want: int, latest: bool = False) -> Entry | None:
        """The lowest (newest if `latest`) version >= want that this node can serve now."""
        candidates = sorted({v for v in self.complete() if v >= want}
                            | ({self.incoming.version} if self.incoming and self.incoming.version >= want else set()))
        for v in reversed(candidates) if latest else candidates:
            entry = self.get(v)
            if entry is not None:
                return entry
        return None

    def get(self, version: int) -> Entry | None:
        """The version if this node can serve it (holding it from now on), else None."""
        if self.incoming is not None and self.incoming.version == version:
            return self.incoming
        stored = self._held.get(version)
        if stored is None:
            try:
                stored = self._held[version] = Stored(self.root, self.run, version, self.part)
            except FileNotFoundError:
                return None
        stored.last_used = time.monotonic()
        return stored

    def release_idle(self) -> None:
        """Stop holding versions nobody asked for within `idle_s`, so the collector may take them."""
        now = time.monotonic()
        for v, stored in list(self._held.items()):
            if now - stored.last_used > self.idle_s:
                stored.close()
                del self._held[v]

    def close(self) -> None:
        for stored in self._held.values():
            stored.close()
        self._held.clear()

