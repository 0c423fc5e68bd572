"""Pulling versions from upstream: long-polled offers, a window of chunk requests, and healing.

`Fetcher.run` asks its upstream for the next version it needs (the newest on the first ask, so a
late joiner starts with the newest; then each in order, or the newest again with
`relay.latest_only`), receives it into the store's staging directory with at most `relay.window`
chunk requests in flight (credits: a request goes out only when a reply came back), offers it to its
own downstream from the first byte on, verifies every file against the manifest (sha256) or every chunk
against the source's CRC-32 (files without one) and renames it into place. A version whose check fails
is refused (counted, removed, never announced) and the previous one stays; a version that is gone
upstream is skipped.

Healing: every message from upstream that decodes counts as a sign of life, and while chunks are
parked there a ping (`RelayQuery(wait_s=0)`, answered at once) goes out every quarter of
`relay.peer_timeout_s` (at most a second apart). An upstream silent for the whole timeout, or alive but without a single chunk
for `STALL` timeouts (its own upstream heals within one), is skipped: `Upstream.heal` re-attaches to
the next node up (the source is never skipped), which must offer the same version with the same
manifest; the chunks still missing are asked from it. A fetcher carries one weight format (its
catalog's `fmt`; every request names it); a node relaying several runs one fetcher per format.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from offpolicy.config import RelayConfig, TransportConfig
from offpolicy.plumbing import protocol, transport
from offpolicy.plumbing.keys import CurveClient, apply_client
from offpolicy.relay.catalog import Catalog
from offpolicy.relay.incoming import ChunkMismatch, Incoming, parse_manifest
from offpolicy.relay.metrics import RelayMetrics
from offpolicy.relay.server import ShardServer
from offpolicy.weights.store import Manifest, WeightStore

log = logging.getLogger("offpolicy.relay.fetch")

STALL = 3  # peer timeouts without a chunk after which a live upstream is skipped too


class VersionLost(Exception):
    """The version being fetched is refused here or gone upstream; `outcome` says which."""

    def __init__(self, outcome: str, reason: str):
        super().__init__(reason)
        self.outcome = outcome


class Upstream:
    """The DEALER socket to the current upstream and the nodes to fall back on, nearest first."""

    def __init__(self, ctx: zmq.asyncio.Context, addresses: list[str], cfg: TransportConfig,
                 metrics: RelayMetrics, timeout_s: float, curve: CurveClient | None = None):
        self.ctx, self.addresses, self.cfg, self.metrics, self.timeout_s = ctx, addresses, cfg, metrics, timeout_s
        self.curve = curve  # CurveZMQ client keys (transport.curve): upstream relays are servers
        self.at = 0
        self._connect()

    def _connect(self) -> None:
        self.sock = transport.make_socket(self.ctx, zmq.DEALER, self.cfg)
        if self.curve is not None:
            apply_client(self.sock, self.curve)
        self.sock.connect(self.addresses[self.at])
        self.last_heard = time.monotonic()

    @property
    def address(self) -> str:
        return self.addresses[self.at]

    @property
    def silent(self) -> bool:
        return time.monotonic() - self.last_heard > self.timeout_s

    def heal(self, why: str = "silent") -> None:
        """Skip the upstream: re-attach to the next one up (the last one, the source, is retried)."""
        old = self.address
        self.sock.close(0)
        if self.at < len(self.addresses) - 1:
            self.at += 1
            self.metrics.upstream_switches.inc()
        log.warning("upstream %s %s; re-attaching to %s", old, why, self.address)
        self._connect()

    async def send(self, msg: protocol.Message) -> None:
        try:
            await self.sock.send_multipart(protocol.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no route right now: silence follows, and so does healing

    async def recv(self, timeout_s: float) -> tuple[protocol.Message, list] | None:
        """The next message that decodes, or None after `timeout_s` without one."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not await self.sock.poll(max(1, int(left * 1000))):
                return None
            frames = await self.sock.recv_multipart(copy=False)
            try:
                got = protocol.decode(frames)
            except protocol.ProtocolError as e:
                self.metrics.rejected.labels("bad_message").inc()
                log.warning("undecodable message from upstream %s: %s", self.address, e)
                continue
            self.last_heard = time.monotonic()
            return got
        return None

    def close(self) -> None:
        self.sock.close(0)


OnVersion = Callable[[int, Manifest, float], Awaitable[None]]


class Fetcher:
    def __init__(self, up: Upstream, store: WeightStore, catalog: Catalog, server: ShardServer,
                 metrics: RelayMetrics, cfg: RelayConfig, on_version: OnVersion):
        self.up, self.store, self.catalog, self.server = up, store, catalog, server
        self.metrics, self.cfg, self.on_version = metrics, cfg, on_version
        self.ping_s = min(1.0, cfg.peer_timeout_s / 4)

    async def run(self) -> None:
        """Fetch versions until upstream has nothing more and says the run is over."""
        want, latest = 0, True  # a late joiner starts with the newest version
        while True:
            offer, manifest = await self._query(want, latest)
            if offer.version < 0:
                return
            if not latest and offer.version > want:
                self.metrics.versions.labels("skipped").inc(offer.version - want)
                log.warning("versions %d..%d are gone upstream; skipped", want, offer.version - 1)
            latest = self.cfg.latest_only
            await self._fetch(offer, manifest)
            want = offer.version + 1

    async def _query(self, want: int, latest: bool) -> tuple[protocol.RelayOffer, Manifest | None]:
        """Long-poll upstream for a version >= want; re-attach further up while it is silent."""
        while True:
            await self.up.send(protocol.RelayQuery(want=want, latest=latest, wait_s=self.cfg.peer_timeout_s / 2,
                                                   format=self.catalog.fmt))
            while True:
                got = await self.up.recv(self.cfg.peer_timeout_s)
                if got is None:
                    self.up.heal(f"silent for {self.cfg.peer_timeout_s:.1f}s")
                    break
                msg = got[0]
                if not isinstance(msg, protocol.RelayOffer):
                    continue  # a late reply to a transfer that is over
                self.catalog.newest_heard = max(self.catalog.newest_heard, msg.newest)
                if msg.version >= want:
                    try:
                        return msg, parse_manifest(msg.manifest, msg.version)
                    except protocol.ProtocolError as e:
                        self.metrics.rejected.labels("bad_manifest").inc()
                        log.warning("upstream %s offered a bad manifest: %s", self.up.address, e)
                        await asyncio.sleep(self.ping_s)  # no busy loop on a broken upstream
                        self.up.heal("offered a bad manifest")
                        break
                if msg.version < 0:
                    if msg.ended:
                        return msg, None
                    break  # nothing yet: ask again (a stale answer to a ping is simply dropped)

    async def _fetch(self, offer: protocol.RelayOffer, manifest: Manifest) -> None:
        v, t0 = offer.version, time.monotonic()
        try:
            with self.store.stage(v) as tmp:
                inc = Incoming(tmp, v, offer.manifest, manifest, self.cfg.chunk_bytes)
                self.catalog.incoming = inc
                try:
                    await self.server.wake()  # downstream may start on it now
                    await self._pull(inc)
                    bad = await inc.mismatches()
                    if bad:
                        self.metrics.checksum_failures.inc()
                        raise VersionLost("refused", f"sha256 of {', '.join(sorted(bad))} differs from the manifest")
                    inc.finish()
                finally:
                    inc.close()
                    self.catalog.incoming = None
        except VersionLost as e:
            self.metrics.versions.labels(e.outcome).inc()
            log.error("version %d %s: %s; keeping the previous version", v, e.outcome, e)
            await self.server.dropped(v, f"{e.outcome} upstream: {e}", self.catalog.fmt)
            return
        seconds = time.monotonic() - t0
        self.metrics.versions.labels("complete").inc()
        self.metrics.transfer_seconds.observe(seconds)
        await self.server.wake()
        await self.on_version(v, manifest, seconds)

    async def _pull(self, inc: Incoming) -> None:
        """Receive every chunk of `inc` with at most `window` requests in flight."""
        todo = deque(inc.chunks())
        inflight: dict[tuple[str, int], int] = {}
        last_chunk = time.monotonic()
        while todo or inflight:
            while todo and len(inflight) < self.cfg.window:
                name, off, n = todo.popleft()
                inflight[(name, off)] = n
                await self.up.send(protocol.ChunkRequest(version=inc.version, file=name, offset=off, length=n,
                                                         format=self.catalog.fmt))
            stalled = time.monotonic() - last_chunk > STALL * self.cfg.peer_timeout_s
            got = None if stalled else await self.up.recv(self.ping_s)
            if got is None:
                if stalled or self.up.silent:
                    self.up.heal("sent no chunk for a while" if stalled else
                                 f"silent for {self.cfg.peer_timeout_s:.1f}s")
                    await self._reoffer(inc)
                    todo.extendleft(reversed([(name, off, n) for (name, off), n in inflight.items()]))
                    inflight.clear()
                    last_chunk = time.monotonic()
                else:
                    await self.up.send(protocol.RelayQuery(want=inc.version, wait_s=0, format=self.catalog.fmt))
                continue
            msg, arrays = got
            if isinstance(msg, protocol.Chunk) and msg.version == inc.version:
                if inflight.get((msg.file, msg.offset)) != msg.length:
                    continue  # not asked for (a duplicate after healing): ignore
                try:
                    inc.write(msg.file, msg.offset, arrays[0], msg.crc32)
                except ChunkMismatch as e:
                    self.metrics.checksum_failures.inc()
                    raise VersionLost("refused", f"from upstream {self.up.address}: {e}") from None
                del inflight[(msg.file, msg.offset)]
                last_chunk = time.monotonic()
                self.metrics.bytes.labels("in").inc(msg.length)
                await self.server.arrived(inc.version, msg.file, self.catalog.fmt)
            elif isinstance(msg, protocol.RelayMissing) and msg.version == inc.version:
                raise VersionLost("skipped", f"upstream {self.up.address} lost it ({msg.reason})")
            elif isinstance(msg, protocol.Error):
                raise VersionLost("skipped", f"upstream {self.up.address} refused a request: {msg.message}")
            elif isinstance(msg, protocol.RelayOffer):
                self.catalog.newest_heard = max(self.catalog.newest_heard, msg.newest)

    async def _reoffer(self, inc: Incoming) -> None:
        """After re-attaching: the new upstream must offer this very version (same manifest)."""
        offer, _ = await self._query(inc.version, latest=False)
        if offer.version != inc.version or offer.manifest != inc.raw:
            raise VersionLost("skipped", f"new upstream {self.up.address} offers version {offer.version} instead")
