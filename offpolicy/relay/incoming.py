"""A version being received: its files in the store's hidden staging directory, filled chunk by chunk.

Every file of the manifest is created at its final size (mode 0600) in the directory that
`WeightStore.stage` hands out; chunks are written where they belong with `pwrite`, in any order, and
the same bytes can be served onward (zero-copy views on a read-only map) as soon as they are here, so
a chain forwards while it receives. What is checked depends on the learner's manifest:
- a file with a sha256 (`weights.checksum: sha256`) is hashed in order as its contiguous prefix grows,
  on one worker thread (hashlib drops the GIL), and compared once complete (`mismatches`);
- a file without one (`checksum: none`, the default from a GPU) is checked chunk by chunk as each one
  arrives, against the CRC-32 the source computed when it read those bytes from the learner's store
  (`Chunk.crc32`); a chunk that does not match, or comes without one, raises `ChunkMismatch`. The
  verified CRC is kept and passed on with the same chunk downstream, so every node checks its bytes
  against the source's read, not against its upstream's copy.

Invariants: nothing outside the manifest's file names is written (names are plain, never paths); no
chunk of a file without a sha256 is written or served before it matched its CRC-32; `manifest.json` is
written last, byte for byte as the upstream sent it, and only after every file matched its size and
checks; a refused version leaves nothing behind (the stage removes it).
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np

from offpolicy.weights.store import MANIFEST, Manifest, write_private
from offpolicy.wire.protocol import ProtocolError


def parse_manifest(raw: bytes, version: int) -> Manifest:
    """Decode an upstream's manifest.json and refuse anything a store could not hold safely."""
    try:
        m = msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"manifest of version {version} does not decode: {e}") from None
    if m.version != version:
        raise ProtocolError(f"manifest says version {m.version}, the offer {version}")
    for name, entry in m.files.items():
        if name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
            raise ProtocolError(f"manifest of version {version} names an unsafe file {name!r}")
        if entry.bytes < 0:
            raise ProtocolError(f"manifest of version {version}: {name} has negative size")
    return m


class ChunkMismatch(ValueError):
    """A chunk of a file without a sha256 does not match the source's CRC-32 of it (or came without one)."""


class Incoming:
    def __init__(self, tmp: Path, version: int, raw_manifest: bytes, manifest: Manifest, chunk_bytes: int):
        self.dir, self.version, self.raw, self.manifest = tmp, version, raw_manifest, manifest
        self.chunk_bytes = chunk_bytes
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap | None] = {}
        self._done: dict[str, bytearray] = {}
        self._hashed: dict[str, int] = {}  # chunks of each file fed to its hasher so far
        self._crcs: dict[str, dict[int, int]] = {name: {} for name in manifest.files}  # verified CRC-32 by chunk
        self._hashers = {name: hashlib.sha256() for name, e in manifest.files.items() if e.sha256}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-sha256")
        self.received = 0
        for name, entry in manifest.files.items():
            fd = os.open(tmp / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._fds[name] = fd
            os.ftruncate(fd, entry.bytes)
            self._maps[name] = mmap.mmap(fd, entry.bytes, prot=mmap.PROT_READ) if entry.bytes else None
            self._done[name] = bytearray(self._count(name))
            self._hashed[name] = 0

    def _count(self, name: str) -> int:
        return -(-self.manifest.files[name].bytes // self.chunk_bytes)

    def chunks(self) -> list[tuple[str, int, int]]:
        """Every (file, offset, length) to fetch, file by file in manifest order."""
        out = []
        for name, entry in self.manifest.files.items():
            for off in range(0, entry.bytes, self.chunk_bytes):
                out.append((name, off, min(self.chunk_bytes, entry.bytes - off)))
        return out

    def write(self, name: str, offset: int, data, crc32: int | None = None) -> None:
        """Store one chunk (as `chunks()` listed it) after checking it against `crc32` (the source's, for a
        file without a sha256: `ChunkMismatch` if it differs or is missing), and feed the in-order hash."""
        i = offset // self.chunk_bytes
        check = not self.manifest.files[name].sha256
        if check:
            got = zlib.crc32(data)  # zlib drops the GIL for large buffers (its rate: docs/weights.md, "Integrity")
            if crc32 != got:
                raise ChunkMismatch(f"{name} bytes {offset}+{memoryview(data).nbytes}: CRC-32 {got:08x}, the "
                                    f"source's {'missing' if crc32 is None else f'{crc32:08x}'}")
        os.pwrite(self._fds[name], data, offset)
        if self._done[name][i]:
            return
        if check:
            self._crcs[name][i] = crc32
        self._done[name][i] = 1
        self.received += memoryview(data).nbytes
        h = self._hashers.get(name)
        if i == self._hashed[name]:  # the usual case, in order: hash the bytes while they are in cache
            if h is not None:
                self._pool.submit(h.update, data)
            self._hashed[name] = i + 1
            self._catch_up(name)

    def _catch_up(self, name: str) -> None:
        """Hash the chunks that arrived early and now continue the hashed prefix (from the file's map)."""
        done, start = self._done[name], self._hashed[name]
        i = start
        while i < len(done) and done[i]:
            i += 1
        h = self._hashers.get(name)
        if h is not None and i > start:
            size = self.manifest.files[name].bytes
            self._pool.submit(h.update, memoryview(self._maps[name])[start * self.chunk_bytes:
                                                                     min(size, i * self.chunk_bytes)])
        self._hashed[name] = i

    @property
    def complete(self) -> bool:
        return all(all(d) for d in self._done.values())

    def serves(self, name: str) -> bool:
        """Every file of a version being received is served onward (a relay holds whole versions)."""
        return True

    def have(self, name: str, offset: int, length: int) -> bool:
        """Whether bytes offset..offset+length of `name` are here (requests are checked against the size first)."""
        if length == 0:
            return True
        done = self._done[name]
        first, last = offset // self.chunk_bytes, (offset + length - 1) // self.chunk_bytes
        return all(done[first: last + 1])

    def crc32(self, name: str, offset: int, length: int) -> int | None:
        """The CRC-32 to send downstream with these bytes (None for a file with a sha256): the source's, as
        verified on arrival, for a chunk of this node's grid, else computed here from the received bytes."""
        size = self.manifest.files[name].bytes
        if self.manifest.files[name].sha256:
            return None
        if offset % self.chunk_bytes == 0 and length == min(self.chunk_bytes, size - offset):
            kept = self._crcs[name].get(offset // self.chunk_bytes)
            if kept is not None:
                return kept
        return zlib.crc32(self.view(name, offset, length))

    def view(self, name: str, offset: int, length: int) -> np.ndarray:
        mm = self._maps[name]
        if mm is None or length == 0:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(mm, dtype=np.uint8, count=length, offset=offset)

    async def mismatches(self) -> list[str]:
        """Files whose sha256 differs from the manifest (after every queued hash update ran)."""
        digests = await asyncio.wrap_future(self._pool.submit(lambda: {n: h.hexdigest() for n, h in
                                                                      self._hashers.items()}))
        return [n for n, d in digests.items() if d != self.manifest.files[n].sha256]

    def finish(self) -> None:
        """Every file matched: write manifest.json last (the stage renames the directory next)."""
        write_private(self.dir / MANIFEST, self.raw)

    def close(self) -> None:
        """Release the files; maps still lent to ZeroMQ sends stay valid until those complete."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()
