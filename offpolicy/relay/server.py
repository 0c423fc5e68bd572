"""The shard server: answers downstream relays on a ROUTER socket from a node's `Catalog`.

Two requests (offpolicy/wire/protocol.py): `RelayQuery(want, latest, wait_s)` is answered with a
`RelayOffer` of the lowest (or newest) version >= want, parked up to `wait_s` while there is none (a
long poll, so news of a version travels down the chain at once); `ChunkRequest(version, file, offset,
length)` is answered with a `Chunk` whose frame is a zero-copy view on the file (with its CRC-32 where the
manifest has no sha256 for the file, `Catalog`), parked while that
range of a version being received has not arrived, or with `RelayMissing` when the version is not
here (collected or refused). Each downstream relay keeps at most `relay.window` chunk requests in
flight, so what is parked here stays bounded by the credits it handed out.

A learner node's source (several learner nodes, `relay.sources`) serves its node's part of each version:
it offers the whole manifest and refuses a chunk of a file that another node holds.

Each request names its weight format (`format`, "native" by default); a node serving several formats
(`relay.formats`) answers each from that format's catalog, and refuses a format it does not relay.

Invariants: anything that does not decode or names no file of the version is counted in
`offpolicy_messages_rejected_total{reason}`, answered with `Error` and otherwise ignored; a reply to a
peer that is gone is dropped (ROUTER_MANDATORY); the server never blocks on one peer.
"""

from __future__ import annotations

import logging
import time

import zmq.asyncio

from offpolicy.relay.catalog import Catalog, Entry
from offpolicy.relay.metrics import RelayMetrics
from offpolicy.weights.formats import NATIVE
from offpolicy.wire import protocol, transport

log = logging.getLogger("offpolicy.relay.server")

MAX_CHUNK = 256 * 1024**2  # a request for more is refused


class ShardServer:
    def __init__(self, sock: zmq.asyncio.Socket, catalog: Catalog, metrics: RelayMetrics, *more: Catalog):
        self.sock, self.catalog, self.metrics = sock, catalog, metrics
        self.catalogs = {c.fmt: c for c in (catalog, *more)}  # one per relayed weight format
        self._queries: list[tuple[bytes, protocol.RelayQuery, float]] = []  # (peer, query, deadline)
        self._chunks: list[tuple[bytes, protocol.ChunkRequest]] = []  # waiting for bytes of the incoming version
        self.last_request = time.monotonic()

    async def serve_forever(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            await self.handle(frames[0].bytes, frames[1:])

    async def handle(self, peer: bytes, frames: list) -> None:
        try:
            msg, _ = protocol.decode(frames)
        except protocol.ProtocolError as e:
            reason = "protocol_version" if "protocol version" in str(e) else "bad_message"
            await self._refuse(peer, reason, str(e))
            return
        self.last_request = time.monotonic()
        if isinstance(msg, (protocol.RelayQuery, protocol.ChunkRequest)) and msg.format not in self.catalogs:
            await self._refuse(peer, "bad_request", f"weight format {msg.format!r} is not relayed here (this node "
                                                    f"serves {sorted(self.catalogs)}): see relay.formats")
        elif isinstance(msg, protocol.RelayQuery):
            if not await self._answer_query(peer, msg, final=msg.wait_s <= 0):
                self._queries.append((peer, msg, time.monotonic() + min(msg.wait_s, 60.0)))
        elif isinstance(msg, protocol.ChunkRequest):
            await self._answer_chunk(peer, msg)
        else:
            await self._refuse(peer, "unexpected", f"a relay server does not take {type(msg).__name__}")

    async def _refuse(self, peer: bytes, reason: str, text: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        log.warning("refused a message from %r: %s", peer, text)
        await transport.send(self.sock, protocol.Error(code=reason, message=text[:200]), to=peer)

    def _offer(self, c: Catalog, entry: Entry | None) -> protocol.RelayOffer:
        if entry is None:
            return protocol.RelayOffer(version=-1, newest=c.newest(), ended=c.ended)
        return protocol.RelayOffer(version=entry.version, newest=c.newest(), ended=c.ended, manifest=entry.raw)

    async def _answer_query(self, peer: bytes, q: protocol.RelayQuery, final: bool) -> bool:
        """Answer `q` if there is a version for it (or if `final`, or the run is over); False = park it."""
        c = self.catalogs[q.format]
        entry = c.offer(q.want, q.latest)
        if entry is None and not final and not c.ended:
            return False
        await transport.send(self.sock, self._offer(c, entry), to=peer)
        return True

    async def _answer_chunk(self, peer: bytes, req: protocol.ChunkRequest) -> None:
        entry = self.catalogs[req.format].get(req.version)
        if entry is None:
            await transport.send(self.sock, protocol.RelayMissing(version=req.version, reason="not here"), to=peer)
            return
        f = entry.manifest.files.get(req.file)
        if f is None or req.offset < 0 or req.length < 0 or req.length > MAX_CHUNK or req.offset + req.length > f.bytes:
            await self._refuse(peer, "bad_request", f"no bytes {req.offset}+{req.length} of {req.file!r} in "
                                                    f"version {req.version}")
            return
        if not entry.serves(req.file):  # a learner node's source asked for another node's file
            await self._refuse(peer, "bad_request", f"{req.file!r} of version {req.version} is learner node "
                                                    f"{f.node}'s; this source serves node {entry.part}'s part "
                                                    "(check the order of relay.sources)")
            return
        if not entry.have(req.file, req.offset, req.length):
            self._chunks.append((peer, req))
            return
        await self._send_chunk(peer, req, entry)

    async def _send_chunk(self, peer: bytes, req: protocol.ChunkRequest, entry: Entry) -> None:
        data = entry.view(req.file, req.offset, req.length)
        reply = protocol.Chunk(version=req.version, file=req.file, offset=req.offset, length=req.length,
                               crc32=entry.crc32(req.file, req.offset, req.length))
        if await transport.send(self.sock, reply, data, to=peer):
            self.metrics.bytes.labels("out").inc(req.length)

    async def wake(self) -> None:
        """The catalog changed (a version arrived or began, or the run ended): answer what can be answered."""
        now, parked, self._queries = time.monotonic(), self._queries, []  # sends may let new ones park
        for peer, q, deadline in parked:
            if not await self._answer_query(peer, q, final=now >= deadline):
                self._queries.append((peer, q, deadline))

    async def arrived(self, version: int, name: str, fmt: str = NATIVE) -> None:
        """New bytes of `name` in the incoming version (of format `fmt`): send the parked requests they complete."""
        entry, parked, self._chunks = self.catalogs[fmt].get(version), self._chunks, []
        for peer, req in parked:
            if entry is not None and req.format == fmt and req.version == version and req.file == name and \
                    entry.have(req.file, req.offset, req.length):
                await self._send_chunk(peer, req, entry)
            else:
                self._chunks.append((peer, req))

    async def dropped(self, version: int, reason: str, fmt: str = NATIVE) -> None:
        """The incoming `version` (of format `fmt`) was abandoned or refused: tell whoever waits for its bytes."""
        gone = {p for p, r in self._chunks if r.version == version and r.format == fmt}
        self._chunks = [(p, r) for p, r in self._chunks if not (r.version == version and r.format == fmt)]
        for peer in gone:
            await transport.send(self.sock, protocol.RelayMissing(version=version, reason=reason), to=peer)
