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

A learner on several nodes (`relay.sources`, two or more): each learner node's source serves only its
node's part of a version (catalog.py), so "the source" is one `Upstream` per learner node (`parts`, in
node order, none ever skipped). Pulling from the sources, a fetcher asks every one of them for a
version (the same number from all, with the same manifest, whose files lie on those nodes), then each
file's chunks from the source of the node that holds it (the manifest's `node`), every part's window
and healing as above, concurrently, into one `Incoming`: the version is verified and renamed into place
only when every file of every part is complete. A source silent or without the version holds the
version back (logged; asked again, as the single source is), and no version appears without it.
Relays further down pull whole versions from their relays as before; one whose last relay upstream is
skipped re-attaches to the sources (`Rerouted`) and asks them for the chunks still missing.
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
from offpolicy.relay.catalog import Catalog
from offpolicy.relay.incoming import ChunkMismatch, Incoming, parse_manifest
from offpolicy.relay.metrics import RelayMetrics
from offpolicy.relay.server import ShardServer
from offpolicy.weights.store import Manifest, WeightStore
from offpolicy.wire import protocol, transport
from offpolicy.wire.keys import CurveClient, apply_client

log = logging.getLogger("offpolicy.relay.fetch")

STALL = 3  # peer timeouts without a chunk after which a live upstream is skipped too


class VersionLost(Exception):
    """The version being fetched is refused here or gone upstream; `outcome` says which."""

    def __init__(self, outcome: str, reason: str, version: int = -1):
        super().__init__(reason)
        self.outcome, self.version = outcome, version


class Rerouted(Exception):
    """The last relay upstream was skipped: what is left comes from the learner nodes' sources (`todo`)."""

    def __init__(self, todo: list[tuple[str, int, int]] | None = None):
        super().__init__("re-attaching to the learner nodes' sources")
        self.todo = todo or []


class Upstream:
    """The DEALER socket to the current upstream and the nodes to fall back on, nearest first. The last one
    is retried, never skipped (a source), unless `final` is False: then skipping it is `Rerouted` (relays
    in front of several learner nodes' sources). `name` says what it is in logs."""

    def __init__(self, ctx: zmq.asyncio.Context, addresses: list[str], cfg: TransportConfig,
                 metrics: RelayMetrics, timeout_s: float, curve: CurveClient | None = None, final: bool = True,
                 name: str = "upstream"):
        self.ctx, self.addresses, self.cfg, self.metrics, self.timeout_s = ctx, addresses, cfg, metrics, timeout_s
        self.curve = curve  # CurveZMQ client keys (transport.curve): upstream relays are servers
        self.final, self.name = final, name
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
        """Skip the upstream: re-attach to the next one up (the last one, the source, is retried); past the
        last one of a list that is not `final`, raise `Rerouted`."""
        old = self.address
        self.sock.close(0)
        if self.at < len(self.addresses) - 1:
            self.at += 1
            self.metrics.upstream_switches.inc()
        elif not self.final:
            self.metrics.upstream_switches.inc()
            log.warning("%s %s %s; re-attaching to the learner nodes' sources", self.name, old, why)
            raise Rerouted()
        log.warning("%s %s %s; re-attaching to %s", self.name, old, why, self.address)
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
    """Pulls versions into `store`: from `up` (relays nearest first, then the one source), or with several
    learner nodes from `up` (relays only, may be None) and then `parts` (one source per learner node)."""

    def __init__(self, up: Upstream | None, store: WeightStore, catalog: Catalog, server: ShardServer,
                 metrics: RelayMetrics, cfg: RelayConfig, on_version: OnVersion, parts: list[Upstream] | None = None):
        self.up, self.parts, self.store, self.catalog, self.server = up, parts, store, catalog, server
        self.metrics, self.cfg, self.on_version = metrics, cfg, on_version
        self.ping_s = min(1.0, cfg.peer_timeout_s / 4)
        if up is None and not parts:
            raise ValueError("a fetcher needs an upstream or the learner nodes' sources")

    async def run(self) -> None:
        """Fetch versions until upstream has nothing more and says the run is over."""
        want, latest = 0, True  # a late joiner starts with the newest version
        while True:
            try:
                offer, manifest = await self._query(want, latest)
            except VersionLost as e:  # the learner nodes' parts do not make one version
                self.metrics.versions.labels(e.outcome).inc()
                log.error("version %d %s: %s", e.version, e.outcome, e)
                want, latest = e.version + 1, self.cfg.latest_only
                continue
            if offer.version < 0:
                return
            if not latest and offer.version > want:
                self.metrics.versions.labels("skipped").inc(offer.version - want)
                log.warning("versions %d..%d are gone upstream; skipped", want, offer.version - 1)
            latest = self.cfg.latest_only
            await self._fetch(offer, manifest)
            want = offer.version + 1

    async def _query(self, want: int, latest: bool) -> tuple[protocol.RelayOffer, Manifest | None]:
        """Long-poll upstream (or every learner node's source) for a version >= want."""
        if self.up is not None:
            try:
                return await self._query_one(self.up, want, latest)
            except Rerouted:
                self.up = None
        return await self._query_parts(want, latest)

    async def _query_one(self, up: Upstream, want: int, latest: bool) -> tuple[protocol.RelayOffer, Manifest | None]:
        """Long-poll `up` for a version >= want; re-attach further up while it is silent."""
        while True:
            await up.send(protocol.RelayQuery(want=want, latest=latest, wait_s=self.cfg.peer_timeout_s / 2,
                                              format=self.catalog.fmt))
            while True:
                got = await up.recv(self.cfg.peer_timeout_s)
                if got is None:
                    up.heal(f"silent for {self.cfg.peer_timeout_s:.1f}s")
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
                        log.warning("%s %s offered a bad manifest: %s", up.name, up.address, e)
                        await asyncio.sleep(self.ping_s)  # no busy loop on a broken upstream
                        up.heal("offered a bad manifest")
                        break
                if msg.version < 0:
                    if msg.ended:
                        return msg, None
                    break  # nothing yet: ask again (a stale answer to a ping is simply dropped)

    async def _query_parts(self, want: int, latest: bool) -> tuple[protocol.RelayOffer, Manifest | None]:
        """Long-poll every learner node's source until all of them offer the same version >= want; raise
        `VersionLost` ("refused") when their parts of it do not make one version."""
        parts = self.parts
        while True:
            tasks = [asyncio.ensure_future(self._query_one(up, want, latest)) for up in parts]
            try:
                while True:
                    done, pending = await asyncio.wait(tasks, timeout=2 * self.cfg.peer_timeout_s)
                    if not pending:
                        break
                    if done and not any(t.result()[0].version < 0 for t in done):
                        have = sorted({t.result()[0].version for t in done})
                        late = [k for k, t in enumerate(tasks) if t in pending]
                        log.warning("version %s offered by learner node(s) %s; waiting for the part of node(s) %s "
                                    "(%s): no version appears without every node's part", "/".join(map(str, have)),
                                    [k for k, t in enumerate(tasks) if t in done], late,
                                    ", ".join(parts[k].address for k in late))
            finally:
                for t in tasks:
                    t.cancel()
            got = [t.result() for t in tasks]
            offers = [o for o, _ in got]
            ended = [o for o in offers if o.version < 0]
            if ended:  # a source holds no version >= want and never will: nothing more can be complete
                if len(ended) < len(offers):
                    log.error("the run is over at learner node(s) %s with no version >= %d there; the other "
                              "nodes' parts cannot make a version", [k for k, o in enumerate(offers) if o.version < 0],
                              want)
                return ended[0], None
            v = max(o.version for o in offers)
            if any(o.version != v for o in offers):
                want, latest = v, False  # the nodes without it yet commit it soon (or skipped it: then higher)
                continue
            manifest = got[0][1]
            if len({o.manifest for o in offers}) > 1:
                raise VersionLost("refused", "the learner nodes' parts carry different manifests "
                                  "(a stale store on one node?)", v)
            nodes = {e.node for e in manifest.files.values()}
            if not nodes <= set(range(len(parts))):  # (every learner node commits a part, files or not)
                raise VersionLost("refused", f"its files lie on learner nodes {sorted(nodes)}, relay.sources lists "
                                  f"{len(parts)}: list every learner node's host there, in the learner's node order", v)
            return offers[0], manifest

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
        """Receive every chunk of `inc`: from the upstream, or each file's from its learner node's source."""
        todo = inc.chunks()
        if self.up is not None:
            try:
                await self._pull_from(self.up, inc, todo)
                return
            except Rerouted as e:
                self.up, todo = None, e.todo
                await self._reoffer_parts(inc)
        await self._pull_parts(inc, todo)

    async def _pull_parts(self, inc: Incoming, todo: list[tuple[str, int, int]]) -> None:
        """Each learner node's chunks from its source, all parts at once (each its own window and healing)."""
        by_node: list[list[tuple[str, int, int]]] = [[] for _ in self.parts]
        for chunk in todo:
            by_node[inc.manifest.files[chunk[0]].node].append(chunk)
        try:
            async with asyncio.TaskGroup() as tg:
                for up, chunks in zip(self.parts, by_node):
                    if chunks:
                        tg.create_task(self._pull_from(up, inc, chunks))
        except BaseExceptionGroup as group:  # the first part to fail ends the version (the others are cancelled)
            lost = [e for e in group.exceptions if isinstance(e, VersionLost)]
            raise (lost or list(group.exceptions))[0] from None

    async def _pull_from(self, up: Upstream, inc: Incoming, chunks: list[tuple[str, int, int]]) -> None:
        """Receive `chunks` of `inc` from `up` with at most `window` requests in flight; `Rerouted` carries
        the chunks still missing when `up` was the last relay before the learner nodes' sources."""
        todo = deque(chunks)
        inflight: dict[tuple[str, int], int] = {}
        try:
            await self._pull_window(up, inc, todo, inflight)
        except Rerouted:
            raise Rerouted([*((name, off, n) for (name, off), n in inflight.items()), *todo]) from None

    async def _pull_window(self, up: Upstream, inc: Incoming, todo: deque, inflight: dict[tuple[str, int], int]) -> None:
        last_chunk = time.monotonic()
        while todo or inflight:
            while todo and len(inflight) < self.cfg.window:
                name, off, n = todo.popleft()
                inflight[(name, off)] = n
                await up.send(protocol.ChunkRequest(version=inc.version, file=name, offset=off, length=n,
                                                    format=self.catalog.fmt))
            stalled = time.monotonic() - last_chunk > STALL * self.cfg.peer_timeout_s
            got = None if stalled else await up.recv(self.ping_s)
            if got is None:
                if stalled or up.silent:
                    up.heal("sent no chunk for a while" if stalled else
                            f"silent for {self.cfg.peer_timeout_s:.1f}s")
                    await self._reoffer(inc, up)
                    todo.extendleft(reversed([(name, off, n) for (name, off), n in inflight.items()]))
                    inflight.clear()
                    last_chunk = time.monotonic()
                else:
                    await up.send(protocol.RelayQuery(want=inc.version, wait_s=0, format=self.catalog.fmt))
                continue
            msg, arrays = got
            if isinstance(msg, protocol.Chunk) and msg.version == inc.version:
                if inflight.get((msg.file, msg.offset)) != msg.length:
                    continue  # not asked for (a duplicate after healing): ignore
                try:
                    inc.write(msg.file, msg.offset, arrays[0], msg.crc32)
                except ChunkMismatch as e:
                    self.metrics.checksum_failures.inc()
                    raise VersionLost("refused", f"from {up.name} {up.address}: {e}") from None
                del inflight[(msg.file, msg.offset)]
                last_chunk = time.monotonic()
                self.metrics.bytes.labels("in").inc(msg.length)
                await self.server.arrived(inc.version, msg.file, self.catalog.fmt)
            elif isinstance(msg, protocol.RelayMissing) and msg.version == inc.version:
                raise VersionLost("skipped", f"{up.name} {up.address} lost it ({msg.reason})")
            elif isinstance(msg, protocol.Error):
                raise VersionLost("skipped", f"{up.name} {up.address} refused a request: {msg.message}")
            elif isinstance(msg, protocol.RelayOffer):
                self.catalog.newest_heard = max(self.catalog.newest_heard, msg.newest)

    async def _reoffer(self, inc: Incoming, up: Upstream) -> None:
        """After re-attaching: the new upstream must offer this very version (same manifest)."""
        offer, _ = await self._query_one(up, inc.version, latest=False)
        if offer.version != inc.version or offer.manifest != inc.raw:
            raise VersionLost("skipped", f"new {up.name} {up.address} offers version {offer.version} instead")

    async def _reoffer_parts(self, inc: Incoming) -> None:
        """After re-attaching to the learner nodes' sources: all of them must offer this version (same manifest)."""
        offer, _ = await self._query_parts(inc.version, latest=False)
        if offer.version != inc.version or offer.manifest != inc.raw:
            raise VersionLost("skipped", f"the learner nodes' sources offer version {offer.version} instead")
