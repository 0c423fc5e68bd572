"""The rollout daemon: asks the hub for work, generates and scores groups, streams them back.

Tasks on one event loop: `_receive` (leases, acks of one or more groups, errors, goodbye from the
hub's ROUTER, through `transport.receive`), `_heartbeat`, and `_work`, which keeps
`1 + prefetch_leases` leases requested or held (credits: one `WorkRequest` of `groups_per_lease`
outstanding at a time), swaps the engine to the newest weight version between leases (never below a
lease's `min_version`: `swap.WeightSwapper`, which follows new versions through the public
`offpolicy.weights.subscribe` API in a background thread and, where the engine double-buffers its weights,
hands each version to the engine's prefetcher as it arrives; with `rollout.inflight_updates` the engine may also
switch to a newer one between decode steps, which the swapper takes note of after each lease), and generates, scores and sends one
`SampleGroup` per prompt (`generation.LeaseGenerator`). The daemon itself keeps the session with the
hub (Hello until Welcome; joining again when a restarted learner no longer knows it) and its
lifecycle: it exits on the hub's Goodbye or on SIGTERM/SIGINT, 1 if a task failed or its engine was lost for
good (`RolloutEngine.on_lost`: the in-process SGLang engine's scheduler died), so that its supervisor restarts it.
Once it stops, it is gone within `STOP_DEADLINE_S` whatever it was doing (waiting for the learner or a server,
mid-load, mid-generate): the groups it finished were sent, the lease it was generating expires at the hub and its
prompts go to another rollout; an engine that can be interrupted (vLLM's wait for a server) is, and a
thread still blocked past the deadline (an HTTP call to a hung server) no longer holds the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import numpy as np
import zmq
import zmq.asyncio

from offpolicy.config import Config, learner_host
from offpolicy.plumbing.lifetime import exit_deadline
from offpolicy.plumbing.logs import RateLimitedLog
from offpolicy.plumbing.metrics import RolloutMetrics, serve
from offpolicy.plumbing.trace import Tracer, now
from offpolicy.rollout.engines import make_engine, prefetcher_of, response_tokenizer
from offpolicy.rollout.engines.errors import EngineLost, Stopped
from offpolicy.rollout.generation import LeaseGenerator
from offpolicy.rollout.swap import VersionFollower, WeightSwapper, announce_address
from offpolicy.wire import protocol, transport
from offpolicy.wire.keys import apply_client, load_client

__all__ = ["RolloutDaemon", "VersionFollower", "announce_address"]  # the followers live in swap.py

log = logging.getLogger("offpolicy.rollout")

STOP_DEADLINE_S = 3.0  # a stopping daemon is gone this long after its stop at the latest (docs/operations.md)


class RolloutDaemon:
    def __init__(self, cfg: Config, index: int = 0):
        self.cfg, self.index = cfg, index
        self.slot = f"rollout-{index}@{socket.gethostname()}"  # the same after a restart: the hub frees its leases
        self.daemon_id = f"{self.slot}:{os.getpid()}"
        self.m = RolloutMetrics()
        self.rate_log = RateLimitedLog(log)  # refusals and bad messages: a line per second per reason at most
        self.engine = make_engine(cfg, seed=cfg.rollout.seed + index)
        self.tracer = Tracer(cfg, f"rollout-{index}")  # run.trace: its waits, loads and generations
        self.generator = LeaseGenerator(cfg, self.engine, response_tokenizer(cfg.model), self.m, self.tracer)
        self.leases: asyncio.Queue = asyncio.Queue()
        self.stop = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.welcome: protocol.Welcome | None = None
        self.refusal: str | None = None
        self.requested = False
        self.rejoining = False
        self.fatal = False
        self.busy = 0
        self.deadline = None  # armed when the daemon stops (exit_deadline)
        self.code = 0  # the exit code the deadline leaves with

    async def run(self) -> int:
        t = self.cfg.transport
        host = learner_host(self.cfg)
        serve(self.m.registry, self.cfg.metrics.port, self.cfg.metrics.host)
        ctx = zmq.asyncio.Context()
        self.dealer = transport.make_socket(ctx, zmq.DEALER, t)
        self.curve = load_client(t.keys_dir, t.client_key) if t.curve else None
        if self.curve is not None:
            apply_client(self.dealer, self.curve)
        self.dealer.connect(transport.tcp(host, t.work_port))
        self.weights = WeightSwapper(self.cfg, self.engine, self.m, announce_address(self.cfg), self.tracer, self.curve,
                                     prefetcher_of(self.cfg, self.engine))  # rollout.double_buffer
        transport.install_stop_signals(self.stop, self._stopping)
        loop = asyncio.get_running_loop()
        self.engine.on_lost(lambda why: loop.call_soon_threadsafe(self._engine_lost, why))
        receiver = asyncio.create_task(self._receive())
        heartbeat: asyncio.Task | None = None
        try:
            welcome = await self._join()
            if welcome is None:
                return 0 if self.stop.is_set() and not self.fatal else 1  # SIGTERM before joining is a clean stop
            self.weights.start()
            # heartbeats from the Welcome on: the first load (a large version into a vLLM server, tens of seconds:
            # docs/benchmarks.md) must not outlast transport.heartbeat_timeout_s in silence, or the hub takes the daemon
            # for dead
            heartbeat = asyncio.create_task(self._heartbeat())
            if welcome.newest_version >= 0:  # a late joiner starts from the newest version
                await self.weights.swap(welcome.newest_version)
            tasks = [receiver, heartbeat, asyncio.create_task(self._work())]
            stopper = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            return await self._end(done - {stopper}, [stopper, *tasks])
        finally:
            receiver.cancel()
            if heartbeat is not None:
                heartbeat.cancel()
            self.weights.close()
            self.dealer.close(0)
            ctx.term()

    async def _end(self, done: set[asyncio.Task], tasks: list[asyncio.Task]) -> int:
        """The first of `tasks` ended (`done`: those of the daemon's own that did): stop the others and say the exit
        code, 1 where one of them failed or the engine was lost."""
        failed = [t for t in done if self._failed(t)]
        self.code = 1 if self.fatal or failed else 0
        self._stopping()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in failed:  # a lost engine said why, with SGLang's traceback above it: no traceback of ours to add
            e = t.exception()
            log.error("rollout daemon failed: %r", e, exc_info=None if isinstance(e, EngineLost) else e)
        return self.code

    def _failed(self, task: asyncio.Task) -> bool:
        """The task ended on an error: not one of the stop's own cut (`Stopped`, raised by a generate the stop ended,
        which may finish before the stop's own task is seen done)."""
        if task.cancelled() or task.exception() is None:
            return False
        return not (isinstance(task.exception(), Stopped) and self.deadline is not None)

    def close(self) -> None:
        """Release the engine (its servers' request threads, an in-process engine's processes) once `run`'s loop has
        ended, its executor threads with it (a generate in flight finishes first: an in-process SGLang engine shut
        under it never answers it). Without it the exit waited for the HTTP pools' idle threads until the stop
        deadline cut it, at every stop of a daemon driving vLLM servers (docs/operations.md)."""
        try:
            self.engine.close()
        except Exception as e:  # the exit goes on: the deadline still bounds it
            log.warning("rollout daemon %d: closing its %s engine failed: %s: %s", self.index,
                        self.cfg.rollout.engine, type(e).__name__, e)

    def _stopping(self) -> None:
        """The daemon stops (a signal, the Goodbye, a failure): wake what waits, arm the exit deadline."""
        if self.deadline is not None:
            return
        self.deadline = exit_deadline(STOP_DEADLINE_S, self.code, f"rollout daemon {self.index}")
        self.weights.stop()
        self.engine.interrupt()  # engines with waits of their own (vLLM's recovery) end them

    def _engine_lost(self, why: str) -> None:
        """The engine is gone for good (`RolloutEngine.on_lost`; the engine logged `why`): stop as on a failure, with
        exit code 1, so that the supervisor restarts the daemon; the lease in hand goes back to the hub when it
        expires, or at once when the restarted daemon says Hello under this slot."""
        log.error("rollout daemon %d stops with exit code 1: its engine is lost", self.index)
        self.fatal, self.code = True, 1
        self.stop.set()
        self._stopping()

    async def _join(self) -> protocol.Welcome | None:
        """Hello until Welcome (or a refusal, or transport.connect_timeout_s)."""
        t = self.cfg.transport
        self.welcome, self.refusal = None, None
        self.welcomed.clear()
        await transport.send(self.dealer, protocol.Hello(daemon_id=self.daemon_id, slot=self.slot,
                                                         engine=self.cfg.rollout.engine,
                                                         max_groups=self.cfg.rollout.groups_per_lease))
        waits = [asyncio.create_task(self.welcomed.wait()), asyncio.create_task(self.stop.wait())]
        done, _ = await asyncio.wait(waits, timeout=t.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self.stop.is_set() and not self.welcomed.is_set():
            log.info("stopped before the learner answered")
            return None
        if not done:
            log.error("no answer from the learner at %s:%d within transport.connect_timeout_s=%.0f",
                      learner_host(self.cfg), t.work_port, t.connect_timeout_s)
            return None
        w = self.welcome
        if w is None:
            log.error("hub refused hello: %s", self.refusal)
            return None
        if w.n_samples != self.cfg.rollout.n_samples:
            log.error("learner expects rollout.n_samples=%d, this daemon has %d: use one config",
                      w.n_samples, self.cfg.rollout.n_samples)
            return None
        log.info("joined run %s as %s (newest version %d)", w.run, self.daemon_id, w.newest_version)
        return w

    async def _rejoin(self) -> None:
        """The learner restarted (it does not know us): join again and start over from its newest version."""
        log.warning("the learner does not know this daemon (did it restart?): joining again")
        welcome = await self._join()
        if welcome is None:
            self.fatal = True
            self.stop.set()
            return
        self.weights.restart(max(welcome.newest_version, 0))  # versions past its checkpoint were abandoned
        self.requested = False
        self.rejoining = False
        await self._request_work()

    async def _receive(self) -> None:
        async for batch in transport.receive(self.dealer, rejected=self.m.rejected, log=self.rate_log,
                                             source="the hub"):
            for r in batch:
                await self._on_message(r.msg, r.arrays)

    async def _on_message(self, msg: protocol.Message, arrays: list[np.ndarray]) -> None:
        """One message from the hub (a lease's token array is a view that keeps its frame alive)."""
        if isinstance(msg, protocol.Lease):
            self.requested = False
            self.m.leases.inc()
            await self.leases.put((msg, arrays[0]))
        elif isinstance(msg, protocol.Ack):
            for g in msg.groups:
                if not g.accepted:
                    self.m.groups_refused.labels(g.reason.split(":")[0]).inc()
                    self.rate_log.warning(g.reason.split(":")[0], "hub refused group (lease %d, prompt %d): %s",
                                          g.lease_id, g.prompt_id, g.reason)
        elif isinstance(msg, protocol.Welcome):
            self.welcome = msg
            self.welcomed.set()
        elif isinstance(msg, protocol.Goodbye):
            log.info("learner says goodbye: %s", msg.reason)
            self.stop.set()
        elif isinstance(msg, protocol.Error) and msg.code == "not_welcome":
            if self.welcome is not None and not self.rejoining:
                self.rejoining = True
                asyncio.create_task(self._rejoin())
        elif isinstance(msg, protocol.Error):
            log.error("hub error %s: %s", msg.code, msg.message)
            if not self.welcomed.is_set():
                self.refusal = f"{msg.code}: {msg.message}"
                self.welcomed.set()

    async def _heartbeat(self) -> None:
        while True:
            await transport.send(self.dealer, protocol.Heartbeat(
                daemon_id=self.daemon_id, weight_version=self.engine.version, busy_groups=self.busy))
            await asyncio.sleep(self.cfg.transport.heartbeat_interval_s)

    async def _request_work(self) -> None:
        want = 1 + self.cfg.rollout.prefetch_leases
        held = self.leases.qsize() + (1 if self.busy else 0)
        if not self.requested and held < want:
            self.requested = True
            await transport.send(self.dealer, protocol.WorkRequest(credits=self.cfg.rollout.groups_per_lease))

    async def _work(self) -> None:
        while True:
            await self._request_work()
            t0, began = time.perf_counter(), now()
            lease, tokens = await self.leases.get()
            self.m.idle_seconds.inc(time.perf_counter() - t0)
            self.tracer.add("wait lease", began, time.perf_counter() - t0, groups=len(lease.prompts))
            self.busy = len(lease.prompts)
            await self._request_work()  # prefetch the next lease while this one generates
            await self.weights.swap(lease.min_version)
            await self.generator.run(self.dealer, lease, tokens)
            self.weights.adopt_inflight()  # versions the engine switched to between decode steps (inflight_updates)
            self.busy = 0
