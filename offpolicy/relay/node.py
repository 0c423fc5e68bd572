"""The `offpolicy-relay` daemon: a relay on a rollout node, or (`index = -1`) the learner-side source.

Every node runs a `ShardServer` on `relay.port` and listens to the learner's announcements (newest
version for the lag gauge; the source also wakes on them and ends on the learner's Goodbye). A relay
also starts a fresh store of its own (it removes its run's directory first, like the learner),
follows its upstream with a `Fetcher`, announces each version it completes on its own PUB socket
(`relay.announce_port`, the same `WeightAnnouncement`, so `offpolicy.weights.subscribe` works on its
node unchanged), collects old versions with `WeightStore.collect` (the `keep` + flock rule) and
forwards the run's end as `Goodbye`. A node whose run is over serves on until nobody asked it
anything for `relay.linger_s`, then exits 0. SIGTERM or SIGINT stops it at once. Weight formats
(`relay.formats`: by default native and every `weights.formats` one) are relayed side by side, each
with its own catalog, store, upstream socket and fetcher; each complete version is announced, and the
node's version is the newest it holds in every format.

A learner on several nodes (`relay.sources`): a source runs on every learner node (`part` = its node)
and serves that node's part of each version; relay 0 (and a relay that re-attaches past every relay
above it) has one upstream socket per learner node and format, and assembles each version from them
(fetch.py). A source that finds the learner writing otherwise than `relay.sources` says (parts with one
source, whole versions with several) logs it once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import time

import zmq
import zmq.asyncio

from offpolicy.config import Config, ConfigError, learner_host
from offpolicy.plumbing import runlock
from offpolicy.plumbing.logs import RateLimitedLog
from offpolicy.plumbing.metrics import serve as serve_metrics
from offpolicy.relay.catalog import Catalog
from offpolicy.relay.fetch import Fetcher, Upstream
from offpolicy.relay.metrics import RelayMetrics
from offpolicy.relay.server import ShardServer
from offpolicy.relay.topology import bind_address, source_host, source_hosts, upstreams
from offpolicy.weights.formats import NATIVE
from offpolicy.weights.store import Manifest, WeightStore, list_versions, run_dir, version_dir
from offpolicy.wire import protocol, transport
from offpolicy.wire.keys import apply_client, curve_server, load_client

log = logging.getLogger("offpolicy.relay")

TICK_S = 0.1  # parked queries expire and the source rescans its store this often


def _bind(sock: zmq.asyncio.Socket, host: str, port: int, field: str) -> None:
    try:
        sock.bind(transport.tcp(host, port))
    except zmq.ZMQError as e:
        raise ConfigError(f"config field {field}: cannot bind {host}:{port} ({e}); pick a free port or "
                          "fix relay.bind_host / relay.nodes") from None


class RelayNode:
    def __init__(self, cfg: Config, index: int, hosts: list[str], part: int | None = None):
        r = cfg.relay
        self.cfg, self.index, self.is_source, self.part = cfg, index, index < 0, part
        sources = source_hosts(cfg)
        own = (sources[part] if part is not None else source_host(cfg)) if self.is_source else hosts[index]
        self.host = bind_address(r.bind_host or own)
        chain = [] if self.is_source else upstreams(index, r.fanout)
        # one learner node: the source ends the chain; several: the relays, then every node's source (parts)
        self.source_addrs = [transport.tcp(h, r.port) for h in sources] if len(sources) > 1 and chain else []
        self.upstream_addrs = [transport.tcp(hosts[i] if i >= 0 else sources[0], r.port)
                               for i in chain if i >= 0 or not self.source_addrs]
        self.metrics = RelayMetrics()
        self.formats = relayed_formats(cfg)
        self.catalogs = [Catalog(cfg.weights.root, cfg.run.name, idle_s=2 * r.peer_timeout_s, fmt=f, part=part)
                         for f in self.formats]
        self._warned = False  # a source: the learner's store layout disagrees with relay.sources (logged once)
        self.stores: dict[str, WeightStore] = {}
        self.pub: zmq.asyncio.Socket | None = None
        self.lock: runlock.RunLock | None = None  # the node's store, held for the life of the process

    async def run(self) -> int:
        cfg, r, t = self.cfg, self.cfg.relay, self.cfg.transport
        if not self.is_source:  # the node's store: one relay owns it (a second one stops here)
            self.lock = runlock.acquire(cfg, role="relay", store_only=True)
        ctx = zmq.asyncio.Context()
        stop = asyncio.Event()
        transport.install_stop_signals(stop)
        router = transport.make_socket(ctx, zmq.ROUTER, t)
        sub = transport.make_socket(ctx, zmq.SUB, t)
        if not self.is_source:
            self.pub = transport.make_socket(ctx, zmq.PUB, t)
        # CurveZMQ (transport.curve): a relay serves (ROUTER, PUB) with the run's server key pair to the
        # allowlisted clients only, and is itself a client of the learner's PUB and of its upstream
        servers = [router] + ([self.pub] if self.pub is not None else [])
        auth = curve_server(ctx, servers, t.keys_dir) if t.curve else None
        client = load_client(t.keys_dir, t.client_key) if t.curve else None
        if client is not None:
            apply_client(sub, client)
        _bind(router, self.host, r.port, "relay.port")
        sub.connect(transport.tcp(learner_host(cfg), t.announce_port))
        server = ShardServer(router, self.catalogs[0], self.metrics, *self.catalogs[1:])
        tasks = [server.serve_forever(), self._news(sub, server), self._housekeeping(server, stop)]
        upstreams: list[Upstream] = []
        if not self.is_source:  # bind everything before clearing the store (owned since the start of run())
            _bind(self.pub, self.host, r.announce_port, "relay.announce_port")
            shutil.rmtree(run_dir(cfg.weights.root, cfg.run.name), ignore_errors=True)  # a fresh store
            fetchers = []
            for catalog in self.catalogs:  # one store, upstream socket(s) and fetcher per relayed format
                fmt = catalog.fmt
                self.stores[fmt] = WeightStore(cfg.weights.root, catalog.run, keep=cfg.weights.keep, fmt=fmt)
                up = Upstream(ctx, self.upstream_addrs, t, self.metrics, r.peer_timeout_s, curve=client,
                              final=not self.source_addrs) if self.upstream_addrs else None
                parts = [Upstream(ctx, [a], t, self.metrics, r.peer_timeout_s, curve=client,
                                  name=f"learner node {k}'s source") for k, a in enumerate(self.source_addrs)]
                upstreams += [u for u in (up, *parts) if u is not None]
                fetchers.append(Fetcher(up, self.stores[fmt], catalog, server, self.metrics, r,
                                        functools.partial(self._announce, catalog), parts=parts or None))
            tasks.append(self._follow(fetchers, server))
        serve_metrics(self.metrics.registry, r.metrics_port, cfg.metrics.host)
        pulling = self.upstream_addrs + ([f"every learner node's part from {' + '.join(self.source_addrs)}"]
                                         if self.source_addrs else [])
        log.info("%s on %s:%d%s; store %s, formats %s", "serving" if self.is_source else "relaying", self.host,
                 r.port, ("" if self.is_source else f", pulling from {' then '.join(pulling)}, announcing "
                          f"on {self.host}:{r.announce_port}") + (" (CurveZMQ)" if t.curve else ""),
                 self.catalogs[0].root + "/" + self.catalogs[0].run if self.is_source
                 else run_dir(cfg.weights.root, cfg.run.name), ", ".join(self.formats))
        running = [asyncio.ensure_future(c) for c in tasks]
        waiter = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([*running, waiter], return_when=asyncio.FIRST_COMPLETED)
        for task in [*running, waiter]:
            task.cancel()
        await asyncio.gather(*running, waiter, return_exceptions=True)
        for catalog in self.catalogs:
            catalog.close()
        for upstream in upstreams:
            upstream.close()
        if auth is not None:
            auth.stop()
        ctx.destroy(0)
        for task in done:  # a task that failed (not stop, not the end of the run) fails the daemon
            if task is not waiter and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        log.info("stopped")
        return 0

    async def _follow(self, fetchers: list[Fetcher], server: ShardServer) -> None:
        async def follow(fetcher: Fetcher) -> None:
            await fetcher.run()
            fetcher.catalog.ended = True

        await asyncio.gather(*(follow(f) for f in fetchers))
        log.info("the run is over upstream; newest version here: %d", self._newest_complete())
        await transport.send(self.pub, protocol.Goodbye(reason="run over (relayed)"))
        await server.wake()
        await asyncio.Event().wait()  # serve on; housekeeping ends the daemon after relay.linger_s

    async def _announce(self, catalog: Catalog, version: int, manifest: Manifest, seconds: float) -> None:
        path = version_dir(self.cfg.weights.root, catalog.run, version)
        await transport.send(self.pub, protocol.WeightAnnouncement(
            version=version, path=str(path), total_bytes=manifest.total_bytes, publish_seconds=seconds, step=version))
        removed = self.stores[catalog.fmt].collect()
        self._gauges()
        log.info("version %d (%s): %.1f MB in %.2fs (%.0f MB/s)%s", version, catalog.fmt, manifest.total_bytes / 1e6,
                 seconds, manifest.total_bytes / 1e6 / max(seconds, 1e-9), f"; collected {removed}" if removed else "")

    async def _news(self, sub: zmq.asyncio.Socket, server: ShardServer) -> None:
        """The learner's announcements: newest version heard of; the source wakes on them and ends on Goodbye."""
        async for batch in transport.receive(sub, rejected=self.metrics.rejected, log=RateLimitedLog(log),
                                             source="the learner's announcements"):
            for r in batch:
                await self._on_news(r.msg, server)

    async def _on_news(self, msg: protocol.Message, server: ShardServer) -> None:
        if isinstance(msg, protocol.WeightAnnouncement):
            for catalog in self.catalogs:
                catalog.newest_heard = max(catalog.newest_heard, msg.version)
            self._gauges()
        elif isinstance(msg, protocol.Goodbye) and self.is_source:
            log.info("the learner said goodbye (%s)", msg.reason)
            for catalog in self.catalogs:
                catalog.ended = True
        else:
            return
        if self.is_source:
            await server.wake()

    async def _housekeeping(self, server: ShardServer, stop: asyncio.Event) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(TICK_S)
            await server.wake()  # expires parked queries; the source finds versions it was not told of
            ticks += 1
            if ticks % 10 == 0:
                if self.is_source:
                    self._check_layout()
                for catalog in self.catalogs:
                    catalog.release_idle()
                for store in self.stores.values():
                    store.collect()
                self._gauges()
            ended = all(c.ended for c in self.catalogs)
            if ended and time.monotonic() - server.last_request > self.cfg.relay.linger_s:
                log.info("nobody asked for %.1fs after the end of the run; exiting", self.cfg.relay.linger_s)
                stop.set()

    def _check_layout(self) -> None:
        """A source: warn once when the learner's store holds what relay.sources does not expect."""
        root, run = self.cfg.weights.root, self.cfg.run.name
        if self._warned:
            return
        if self.part is None and run_dir(root, run).joinpath("node0").is_dir():
            self._warned = True
            log.warning("%s holds learner node parts (node0/): the learner runs on several nodes, so list every "
                        "learner node's host in relay.sources (this source serves nothing)", run_dir(root, run))
        elif self.part is not None and list_versions(root, run):
            self._warned = True
            log.warning("%s holds whole versions: the learner runs on one node, so relay.sources must list at most "
                        "one host (this source serves only node %d's parts)", run_dir(root, run), self.part)

    def _newest_complete(self) -> int:
        """Newest version this node holds in every relayed format (-1 = none)."""
        return min((c.complete() or [-1])[-1] for c in self.catalogs)

    def _gauges(self) -> None:
        newest = self._newest_complete()
        self.metrics.version.set(newest)
        self.metrics.lag.set(max(0, max(c.newest() for c in self.catalogs) - newest))


def relayed_formats(cfg: Config) -> list[str]:
    """The weight formats a relay brings to its node: relay.formats, or native (unless weights.native publishes it
    only at checkpoints) and every weights.formats."""
    native = [NATIVE] if cfg.weights.native == "every" else []
    return list(cfg.relay.formats) or [*native, *cfg.weights.formats]
