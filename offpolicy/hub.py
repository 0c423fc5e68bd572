"""The hub (learner rank 0): leases prompts to rollouts, takes their samples, feeds the batcher.

Sockets: a ROUTER (`transport.work_port`) that every rollout's DEALER talks to, and a PUB
(`transport.announce_port`) for weight announcements. Work flows by credits: a rollout's
`WorkRequest(credits)` stands until the staleness gate has room, then the hub answers with a `Lease`
(prompt tokens in one array frame, `min_version` = newest version). Messages come in batches
(`transport.receive`: whatever is ready at once); returned groups are checked
(`validation.check_group`), settled against their lease, buffered for the learner's
`next_batch(step)` with their received frames as storage, and answered with one `Ack` per rollout
per batch. A housekeeping task expires overdue leases and silent rollouts, giving their
prompts back to the cursor. Everything malformed is counted and answered, never fatal.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import time
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.asyncio

from offpolicy import protocol, transport
from offpolicy.admission import Batcher, StalenessGate, drop_stale, give_back
from offpolicy.batch import Group, split_frames
from offpolicy.checkpoint import CursorState
from offpolicy.config import Config, sample_message_limit
from offpolicy.keys import curve_server
from offpolicy.logs import RateLimitedLog
from offpolicy.leases import LeaseBook, PromptCursor, PromptRef
from offpolicy.metrics import LearnerMetrics
from offpolicy.prompts import PromptEncoder
from offpolicy.validation import check_group

log = logging.getLogger("offpolicy.hub")


@dataclass
class Peer:
    daemon_id: str
    last_seen: float
    weight_version: int = -1


class Hub:
    def __init__(self, cfg: Config, dataset, tokenizer, metrics: LearnerMetrics, vocab_size: int):
        self.cfg, self.dataset, self.tokenizer, self.m = cfg, dataset, tokenizer, metrics
        self.encoder = PromptEncoder(tokenizer, cfg.data)  # chat template, max_prompt_tokens (offpolicy/prompts.py)
        self.vocab_size = vocab_size
        self.cursor = PromptCursor(len(dataset), cfg.data.shuffle, cfg.data.seed)
        # lease ids start at a random base per hub process, so results for leases of a hub that
        # died (before a resume) are "unknown lease", never mistaken for new ones
        self.incarnation = secrets.randbelow(1 << 30) + 1
        self.book = LeaseBook(first_id=self.incarnation << 32)
        self._expired_counted = 0  # book.expired already exported as offpolicy_leases_expired_total
        self.gate = StalenessGate(cfg.learner.batch_groups, cfg.algo.max_staleness)
        self.batcher = Batcher(self.gate)
        self.peers: dict[bytes, Peer] = {}
        self.requests: dict[bytes, int] = {}  # standing work requests: identity -> credits
        self.newest: protocol.WeightAnnouncement | None = None
        self.dropped_stale = 0
        self._arrived = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._prompt_cache: dict[int, np.ndarray] = {}
        self._outcomes: dict[bytes, list[protocol.GroupOutcome]] = {}  # Acks to send after this receive batch
        self._taken = [0, 0, 0]  # groups, samples, tokens accepted in this receive batch (counted at its end)
        self.rate_log = RateLimitedLog(log)  # a flood of bad input must not become a flood of log lines

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self, ctx: zmq.asyncio.Context, work: str | None = None, announce: str | None = None) -> None:
        """Bind and serve; `work` / `announce` endpoints (e.g. ipc://...) replace the config's TCP ports."""
        t = self.cfg.transport
        # what exists now (modules, the model, the data set) lives for the whole run: out of the cyclic
        # collector's reach, so its full collections, which groups arriving by the thousand trigger, walk
        # only what came after (a full collection over a learner's imports stalled receiving ~100 ms)
        gc.freeze()
        # memory stays bounded: at most transport.hwm queued messages per peer, none larger than a valid
        # sample group (ZeroMQ drops a peer that sends more, before allocating it)
        self.router = transport.make_socket(ctx, zmq.ROUTER, t, max_bytes=sample_message_limit(self.cfg))
        self.pub = transport.make_socket(ctx, zmq.PUB, t)
        # only clients whose public key is in the allowlist get through the handshake
        self._auth = curve_server(ctx, [self.router, self.pub], t.keys_dir) if t.curve else None
        self.router.bind(work or transport.tcp(t.bind_host, t.work_port))
        self.pub.bind(announce or transport.tcp(t.bind_host, t.announce_port))
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._housekeeping()),
                       asyncio.create_task(transport.watch(self.router, self._on_connection_event)),
                       asyncio.create_task(transport.watch(self.pub, self._on_connection_event))]
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
                self.dropped_stale += len(stale)
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
        """Where every handed-out prompt is now (trained ones are counted by the learner)."""
        return {"prompts_handed_out": self.cursor.handed_out, "prompts_requeued": len(self.cursor.requeue),
                "prompts_in_flight": self.book.in_flight(), "prompts_buffered": len(self.batcher)}

    # -- rollout side ----------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        async for batch in transport.receive(self.router, rejected=self.m.rejected, log=self.rate_log,
                                             source="a rollout", on_reject=self._refuse):
            for r in batch:
                await self._handle(r.sender, r.msg, r.arrays)
            await self._end_batch()

    async def _refuse(self, ident: bytes, reason: str, error: protocol.ProtocolError) -> None:
        await transport.send(self.router, protocol.Error(code=reason, message=str(error)), to=ident)

    async def _end_batch(self) -> None:
        """After a receive batch: its counters, and one Ack per rollout for all its groups in it."""
        groups, samples, tokens = self._taken
        if groups:
            self._taken = [0, 0, 0]
            self.m.groups.inc(groups)
            self.m.samples.inc(samples)
            self.m.tokens.inc(tokens)
            self.m.queue_depth.set(len(self.batcher))
        outcomes, self._outcomes = self._outcomes, {}
        for ident, acks in outcomes.items():
            await transport.send(self.router, protocol.Ack(groups=acks), to=ident)

    async def _handle(self, ident: bytes, msg, arrays) -> None:
        now = time.monotonic()
        if isinstance(msg, protocol.Hello):
            old = self.peers.get(ident)
            if old is not None and old.daemon_id != msg.daemon_id:  # the connection now speaks for another daemon:
                self._expire(self.book.expire(now, daemon=old.daemon_id))  # the old one's prompts go to others now
            self.peers[ident] = Peer(msg.daemon_id, now)
            log.info("rollout %s joined (engine %s, up to %d groups)", msg.daemon_id, msg.engine, msg.max_groups)
            newest = self.newest.version if self.newest else -1
            await transport.send(self.router, protocol.Welcome(
                run=self.cfg.run.name, newest_version=newest, n_samples=self.cfg.rollout.n_samples,
                max_new_tokens=self.cfg.rollout.max_new_tokens, incarnation=self.incarnation), to=ident)
            return
        peer = self.peers.get(ident)
        if peer is None:
            self.m.rejected.labels("not_welcome").inc()
            await transport.send(self.router, protocol.Error(code="not_welcome", message="send Hello first"), to=ident)
            return
        peer.last_seen = now
        if isinstance(msg, protocol.WorkRequest):
            self.requests[ident] = max(0, msg.credits)
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

    async def _serve(self) -> None:
        """Answer standing work requests while the staleness gate has room."""
        for ident in list(self.requests):
            room = min(self.requests[ident], self.gate.capacity())
            if room <= 0:
                continue
            if self.newest is None:
                return  # nothing published yet: no version to generate with
            del self.requests[ident]
            refs = self.cursor.take(room)
            self.gate.admit(len(refs))
            rec = self.book.issue(self.peers[ident].daemon_id, refs, self.newest.version,
                                  time.monotonic() + self.cfg.transport.lease_timeout_s)
            tokens = [self._prompt_tokens(r.prompt_id) for r in refs]
            rows = [self.dataset[r.prompt_id] for r in refs]
            prompts = [protocol.LeasePrompt(r.prompt_id, r.epoch, len(t), row.text, row.answer, row.data_source)
                       for r, t, row in zip(refs, tokens, rows)]
            lease = protocol.Lease(lease_id=rec.lease_id, min_version=rec.min_version,
                                   deadline_s=self.cfg.transport.lease_timeout_s, prompts=prompts)
            self.m.leases_issued.inc()
            self.m.prompts_leased.inc(len(refs))
            if not await transport.send(self.router, lease, np.concatenate(tokens), to=ident):
                self._expire(self.book.expire(float("inf"), daemon=rec.daemon))
        self.m.in_flight.set(self.book.in_flight())

    def _prompt_tokens(self, prompt_id: int) -> np.ndarray:
        tokens = self._prompt_cache.get(prompt_id)
        if tokens is None:
            tokens = np.asarray(self.encoder.encode(self.dataset[prompt_id], prompt_id), dtype=protocol.TOKEN_DTYPE)
            if len(self._prompt_cache) < 100_000:
                self._prompt_cache[prompt_id] = tokens
        return tokens

    async def _take_group(self, ident: bytes, peer: Peer, msg: protocol.SampleGroup, arrays) -> None:
        """Check, settle and buffer one returned group; its outcome goes into the batch's Ack."""
        rec = self.book.live.get(msg.lease_id)
        problem = check_group(msg, arrays, n_samples=self.cfg.rollout.n_samples,
                              max_new_tokens=self.cfg.rollout.max_new_tokens, vocab_size=self.vocab_size,
                              min_version=rec.min_version if rec else None, newest_version=self.gate.version)
        status, ref = self.book.settle(msg.lease_id, msg.prompt_id, msg.epoch)
        if status != "ok":
            problem = problem or status
        elif problem is None and arrays[0].tobytes() != self._prompt_tokens(msg.prompt_id).tobytes():
            problem = "prompt tokens differ from the lease"
        elif problem is None and not self.gate.usable(msg.weight_version, self.gate.version):
            problem = "stale"
            self.dropped_stale += 1
        outcomes = self._outcomes.setdefault(ident, [])
        if problem is not None:
            if ref is not None:  # it was a live prompt: regenerate it elsewhere
                give_back(self.cursor, self.gate, [ref])
            self.m.groups_dropped.labels(problem.split(":")[0]).inc()
            self.rate_log.warning(problem.split(":")[0], "refused group (lease %d, prompt %d) from %s: %s",
                                  msg.lease_id, msg.prompt_id, peer.daemon_id, problem)
            outcomes.append(protocol.GroupOutcome(msg.lease_id, msg.prompt_id, False, problem))
            await self._serve()
            return
        responses, logprobs = split_frames(msg.response_lengths, arrays[1], arrays[2])
        self.book.mark_accepted(ref)
        self.batcher.add(Group(prompt_id=msg.prompt_id, epoch=msg.epoch, lease_id=msg.lease_id,
                               weight_version=msg.weight_version, prompt=arrays[0], responses=responses,
                               logprobs=logprobs, rewards=np.asarray(msg.rewards, dtype=np.float64),
                               finish_reasons=msg.finish_reasons, daemon=peer.daemon_id))
        self._taken[0] += 1
        self._taken[1] += len(responses)
        self._taken[2] += sum(msg.response_lengths)
        if len(self.batcher) >= self.gate.batch_groups:  # only then can `next_batch` take one: no wake-up per group
            self._arrived.set()
        outcomes.append(protocol.GroupOutcome(msg.lease_id, msg.prompt_id, True))

    # -- housekeeping ----------------------------------------------------------------------------
    def _expire(self, refs: list[PromptRef]) -> None:
        self.m.leases_expired.inc(self.book.expired - self._expired_counted)  # every path that expires counts
        self._expired_counted = self.book.expired
        if refs:
            give_back(self.cursor, self.gate, refs)
            log.warning("%d prompts returned to the queue from expired leases", len(refs))

    async def _housekeeping(self) -> None:
        t = self.cfg.transport
        while True:
            await asyncio.sleep(min(1.0, t.heartbeat_interval_s))
            now = time.monotonic()
            before = self.book.expired
            self._expire(self.book.expire(now))
            for ident, peer in list(self.peers.items()):
                if now - peer.last_seen > t.heartbeat_timeout_s:
                    log.warning("rollout %s silent for %.0fs: its leases go to others", peer.daemon_id,
                                now - peer.last_seen)
                    self._expire(self.book.expire(now, daemon=peer.daemon_id))
                    del self.peers[ident]
                    self.requests.pop(ident, None)
            self.m.rollouts.set(len(self.peers))
            if self.book.expired != before:
                await self._serve()
