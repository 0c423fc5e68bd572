"""The hub (learner rank 0): leases prompts to rollouts, takes their samples, feeds the batcher.

Sockets: a ROUTER (`transport.work_port`) that every rollout's DEALER talks to, and a PUB
(`transport.announce_port`) for weight announcements. Work flows by credits: a rollout's
`WorkRequest(credits)` stands until the staleness gate has room, then the hub answers with a `Lease`
(prompt tokens in one array frame, `min_version` = newest version): the lease desk
(`lease_desk.py`). Messages come in batches (`transport.receive`: whatever is ready at once);
returned groups go through the intake (`intake.py`: checked, settled against their lease, buffered
for the learner's `next_batch(step)` with their received frames as storage) and are answered with one
`Ack` per rollout per batch (on the run's timeline, `run.trace`: a `receive` span per batch that brought
groups, with their leases). The hub itself keeps the sockets and their lifecycle, the rollouts it
knows (Hello / Welcome, heartbeats), the learner's side (announce, next_batch, checkpoint state) and
a housekeeping task that expires overdue leases and silent rollouts, giving their prompts back to the
cursor. Everything malformed is counted and answered, never fatal.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from offpolicy.config import Config, sample_message_limit
from offpolicy.data.encoding import PromptEncoder
from offpolicy.hub.admission import Batcher, StalenessGate, drop_stale
from offpolicy.hub.batch import Group
from offpolicy.hub.intake import Intake
from offpolicy.hub.lease_desk import LeaseDesk
from offpolicy.hub.leases import CursorState, LeaseBook, PromptCursor, PromptRef
from offpolicy.plumbing.logs import RateLimitedLog
from offpolicy.plumbing.metrics import LearnerMetrics
from offpolicy.plumbing.trace import Tracer, now
from offpolicy.wire import protocol, transport
from offpolicy.wire.keys import curve_server

log = logging.getLogger("offpolicy.hub")


@dataclass
class Peer:
    daemon_id: str
    last_seen: float
    weight_version: int = -1
    slot: str = ""  # Hello.slot: the daemon's place in the run, the same across its restarts


class Hub:
    def __init__(self, cfg: Config, dataset, tokenizer, metrics: LearnerMetrics, vocab_size: int,
                 tracer: Tracer | None = None):
        self.cfg, self.dataset, self.tokenizer, self.m = cfg, dataset, tokenizer, metrics
        self.tracer = tracer or Tracer(cfg, "learner")  # run.trace: the intake of each receive batch with groups
        self.cursor = PromptCursor(len(dataset), cfg.data.shuffle, cfg.data.seed)
        # lease ids start at a random base per hub process, so results for leases of a hub that
        # died (before a resume) are "unknown lease", never mistaken for new ones
        self.incarnation = secrets.randbelow(1 << 30) + 1
        self.book = LeaseBook(first_id=self.incarnation << 32)
        self.gate = StalenessGate(cfg.learner.batch_groups, cfg.algo.max_staleness)
        self.batcher = Batcher(self.gate)
        self.rate_log = RateLimitedLog(log)  # a flood of bad input must not become a flood of log lines
        encoder = PromptEncoder(tokenizer, cfg.data)  # chat template, max_prompt_tokens (offpolicy/data/encoding.py)
        self.desk = LeaseDesk(cfg, dataset, encoder, self.cursor, self.gate, self.book, metrics)
        self.intake = Intake(cfg, vocab_size, self.book, self.cursor, self.gate, self.batcher, metrics, self.rate_log,
                             prompt_tokens=self.desk.prompt_tokens)
        self.peers: dict[bytes, Peer] = {}
        self.newest: protocol.WeightAnnouncement | None = None
        self._dropped_at_step = 0  # groups next_batch dropped as too stale (the intake counts those on arrival)
        self._arrived = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def dropped_stale(self) -> int:
        """Groups dropped as too stale to train on: on arrival, or buffered while the step moved on."""
        return self._dropped_at_step + self.intake.stale

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self, ctx: zmq.asyncio.Context, work: str | None = None, announce: str | None = None) -> None:
        """Bind and serve; `work` / `announce` endpoints (e.g. ipc://...) replace the config's TCP ports."""
        t = self.cfg.transport
        # what exists now (modules, the model, the data set) lives for the whole run: out of the cyclic
        # collector's reach, so its full collections, which groups arriving by the thousand trigger, walk
        # only what came after (a full collection over a learner's imports stalled receiving)
        gc.freeze()
        # memory stays bounded: at most transport.hwm queued messages per peer, none larger than a valid
        # sample group (ZeroMQ drops a peer that sends more, before allocating it)
        self.router = transport.make_socket(ctx, zmq.ROUTER, t, max_bytes=sample_message_limit(self.cfg))
        self.pub = transport.make_socket(ctx, zmq.PUB, t)
        # only clients whose public key is in the allowlist get through the handshake
        self._auth = curve_server(ctx, [self.router, self.pub], t.keys_dir) if t.curve else None
        # monitored from before the bind: the first peer's refused handshake is counted too (a monitor made
        # in the watch task, once the loop got to it, missed what came before)
        monitors = [(sock, transport.monitor(sock)) for sock in (self.router, self.pub)]
        self.router.bind(work or transport.tcp(t.bind_host, t.work_port))
        self.pub.bind(announce or transport.tcp(t.bind_host, t.announce_port))
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._housekeeping()),
                       *(asyncio.create_task(transport.watch(sock, mon, self._on_connection_event))
                         for sock, mon in monitors)]
        log.info("hub listening: work on %s, announcements on %s%s", work or transport.tcp(t.bind_host, t.work_port),
                 announce or transport.tcp(t.bind_host, t.announce_port), " (CurveZMQ)" if t.curve else "")

    def _on_connection_event(self, event: str, endpoint: str) -> None:
        self.m.connections.labels(event).inc()
        if event.endswith("_failed"):
            self.rate_log.warning(event, "refused a connection from %s: %s", endpoint, event)

    async def close(self, reason: str) -> None:
        """Tell every rollout the run is over, then stop."""
        bye = protocol.Goodbye(reason=reason)
        for ident in list(self.peers):
            await transport.send(self.router, bye, to=ident)
        await self.pub.send_multipart(protocol.encode(bye))
        await asyncio.sleep(0.2)  # let the goodbyes leave before LINGER 0 drops them
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.router.close(0)
        self.pub.close(0)
        if self._auth is not None:
            self._auth.stop()

    # -- learner side ----------------------------------------------------------------------------
    async def announce(self, ann: protocol.WeightAnnouncement) -> None:
        """Version `ann.version` is in the store: open the gate for it and tell every subscriber."""
        self.newest = ann
        self.gate.version = ann.version
        self.m.version.set(ann.version)
        await self.pub.send_multipart(protocol.encode(ann))
        await self._serve()

    async def next_batch(self, step: int) -> list[Group]:
        """Wait for `batch_groups` groups that step `step` may train on (sorted by version, epoch, prompt)."""
        while True:
            stale = drop_stale(self.batcher, self.book, self.cursor, step)
            if stale:
                self._dropped_at_step += len(stale)
                self.m.groups_dropped.labels("stale").inc(len(stale))
                await self._serve()
            batch = self.batcher.take(step)
            if batch is not None:
                self.m.queue_depth.set(len(self.batcher))
                # canonical order, so a step's result never depends on the order groups arrived in
                return sorted(batch, key=lambda g: (g.weight_version, g.epoch, g.prompt_id))
            self._arrived.clear()
            try:  # woken when a batch may be complete (`_take_group`), else once a second to check the tasks
                async with asyncio.timeout(1.0):
                    await self._arrived.wait()
            except TimeoutError:
                self._check_tasks()

    def _check_tasks(self) -> None:
        """A hub task that died (a bug) must stop the learner loudly, not leave it deaf."""
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"hub task {task.get_coro().__name__} failed") from task.exception()

    def snapshot(self) -> CursorState:
        """The cursor as a checkpoint keeps it: prompts leased or buffered but not trained go first."""
        c = self.cursor
        pending = list(c.requeue)
        for lease_id in sorted(self.book.live):
            pending += list(self.book.live[lease_id].pending)
        pending += [PromptRef(g.epoch, g.prompt_id) for g in self.batcher.buffer]
        return CursorState(epoch=c.epoch, pos=c.pos, handed_out=c.handed_out,
                           first=[(r.epoch, r.prompt_id) for r in pending])

    def restore(self, state: CursorState, step: int, trained: set[PromptRef]) -> None:
        """Continue from a checkpoint of `step`: its cursor, its trained prompts, its version."""
        self.cursor.restore(state.epoch, state.pos, state.handed_out, [PromptRef(*r) for r in state.first])
        self.book.accepted = set(trained)
        self.gate.version = step
        self.gate.admitted = step * self.gate.batch_groups  # every step consumed one batch

    def accounting(self) -> dict[str, int]:
        """Where every handed-out prompt is now (trained ones are counted by the learner), and how many were given
        back to be leased again since this hub started (`prompts_requeued`; those still waiting: `..._waiting_...`)."""
        return {"prompts_handed_out": self.cursor.handed_out, "prompts_requeued": self.cursor.requeued,
                "prompts_waiting_requeue": len(self.cursor.requeue), "prompts_in_flight": self.book.in_flight(),
                "prompts_buffered": len(self.batcher)}

    # -- rollout side ----------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        async for batch in transport.receive(self.router, rejected=self.m.rejected, log=self.rate_log,
                                             source="a rollout", on_reject=self._refuse):
            began = now()
            for r in batch:
                await self._handle(r.sender, r.msg, r.arrays)
            await self._end_batch()
            leases = sorted({r.msg.lease_id for r in batch if isinstance(r.msg, protocol.SampleGroup)})
            if leases:  # heartbeats and work requests are not drawn
                groups = sum(isinstance(r.msg, protocol.SampleGroup) for r in batch)
                self.tracer.add("receive", began, now() - began, lane="hub", groups=groups, leases=leases)

    async def _refuse(self, ident: bytes, reason: str, error: protocol.ProtocolError) -> None:
        await transport.send(self.router, protocol.Error(code=reason, message=str(error)), to=ident)

    async def _end_batch(self) -> None:
        """After a receive batch: its counters, and one Ack per rollout for all its groups in it."""
        for ident, acks in self.intake.flush().items():
            await transport.send(self.router, protocol.Ack(groups=acks), to=ident)

    async def _handle(self, ident: bytes, msg, arrays) -> None:
        now = time.monotonic()
        if isinstance(msg, protocol.Hello):
            old = self.peers.get(ident)
            if old is not None and old.daemon_id != msg.daemon_id:  # the connection now speaks for another daemon:
                self.desk.expire(self.book.expire(now, daemon=old.daemon_id))  # the old one's prompts go to others now
            replaced = self._replaced(ident, msg, now)
            self.peers[ident] = Peer(msg.daemon_id, now, slot=msg.slot)
            log.info("rollout %s joined (engine %s, up to %d groups)", msg.daemon_id, msg.engine, msg.max_groups)
            newest = self.newest.version if self.newest else -1
            await transport.send(self.router, protocol.Welcome(
                run=self.cfg.run.name, newest_version=newest, n_samples=self.cfg.rollout.n_samples,
                max_new_tokens=self.cfg.rollout.max_new_tokens, incarnation=self.incarnation), to=ident)
            if replaced:
                await self._serve()  # the predecessor's prompts for whoever waits for work
            return
        peer = self.peers.get(ident)
        if peer is None:
            self.m.rejected.labels("not_welcome").inc()
            await transport.send(self.router, protocol.Error(code="not_welcome", message="send Hello first"), to=ident)
            return
        peer.last_seen = now
        if isinstance(msg, protocol.WorkRequest):
            self.desk.request(ident, msg.credits)
            await self._serve()
        elif isinstance(msg, protocol.SampleGroup):
            await self._take_group(ident, peer, msg, arrays)
        elif isinstance(msg, protocol.Heartbeat):
            peer.weight_version = msg.weight_version
        elif isinstance(msg, protocol.VersionQuery):
            if self.newest is not None:
                await transport.send(self.router, self.newest, to=ident)
        else:
            self.m.rejected.labels("unexpected").inc()
            await transport.send(self.router, protocol.Error(
                code="unexpected", message=f"{type(msg).__name__} is not for the hub"), to=ident)

    def _replaced(self, ident: bytes, hello: protocol.Hello, now: float) -> int:
        """A Hello under a slot another daemon holds (a restarted rollout, its predecessor killed): that daemon is
        gone, so its leased prompts go to others now, not after transport.heartbeat_timeout_s of silence."""
        if not hello.slot:
            return 0
        gone = 0
        for other, peer in list(self.peers.items()):
            if other == ident or peer.slot != hello.slot or peer.daemon_id == hello.daemon_id:
                continue
            back = self.book.expire(now, daemon=peer.daemon_id)
            self.desk.expire(back)
            del self.peers[other]
            self.desk.forget(other)
            log.warning("rollout %s took the place of %s (slot %s): its %d leased prompts go to others now",
                        hello.daemon_id, peer.daemon_id, hello.slot, len(back))
            gone += 1
        return gone

    async def _serve(self) -> None:
        """Answer standing work requests while the staleness gate has room (the lease desk)."""
        await self.desk.serve(self.router, self.peers, self.newest)

    async def _take_group(self, ident: bytes, peer: Peer, msg: protocol.SampleGroup, arrays) -> None:
        """One returned group through the intake; a refused one may free room for a waiting request."""
        if self.intake.take(ident, peer.daemon_id, msg, arrays):
            if len(self.batcher) >= self.gate.batch_groups:  # only then can `next_batch` take one: no wake-up per group
                self._arrived.set()
        else:
            await self._serve()

    # -- housekeeping ----------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        t = self.cfg.transport
        while True:
            await asyncio.sleep(min(1.0, t.heartbeat_interval_s))
            now = time.monotonic()
            before = self.book.expired
            self.desk.expire(self.book.expire(now))
            for ident, peer in list(self.peers.items()):
                if now - peer.last_seen > t.heartbeat_timeout_s:
                    log.warning("rollout %s silent for %.0fs: its leases go to others", peer.daemon_id,
                                now - peer.last_seen)
                    self.desk.expire(self.book.expire(now, daemon=peer.daemon_id))
                    del self.peers[ident]
                    self.desk.forget(ident)
            self.m.rollouts.set(len(self.peers))
            if self.book.expired != before:
                await self._serve()
