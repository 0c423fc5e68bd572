"""The rollout daemon: asks the hub for work, generates and scores groups, streams them back.

Tasks on one event loop: `_receive` (leases, acks of one or more groups, errors, goodbye from the
hub's ROUTER, through `transport.receive`), `_heartbeat`, and `_work`, which keeps
`1 + prefetch_leases` leases requested or held, swaps the engine to the newest weight version
between batches (never below a lease's `min_version`; the loaded version stays held until the next),
generates in a worker thread and sends one `SampleGroup` per prompt. New versions arrive through
the public `offpolicy.weights.subscribe` API, followed in a background thread. The daemon exits on
the hub's Goodbye or on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time

import numpy as np
import zmq
import zmq.asyncio

from offpolicy import protocol, transport
from offpolicy.config import Config, learner_host
from offpolicy.engines import SamplingParams, make_engine, prompt_seed
from offpolicy.keys import CurveClient, apply_client, load_client
from offpolicy.logs import RateLimitedLog
from offpolicy.metrics import RolloutMetrics, serve
from offpolicy.rewards import get_reward
from offpolicy.tokenizer import load_tokenizer
from offpolicy.weights import WeightVersion, subscribe
from offpolicy.weights.formats import store_run

log = logging.getLogger("offpolicy.rollout")


class VersionFollower:
    """Follows weight versions in a thread via `subscribe`; holds the newest one not yet loaded."""

    def __init__(self, cfg: Config, announce: str, start: int = 0, curve: CurveClient | None = None,
                 poll_s: float = 0.25):
        self.cfg, self.announce, self.start, self.curve = cfg, announce, start, curve
        self.poll_s = poll_s  # store scans when no announcement came: the fallback for a lost one
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._newest: WeightVersion | None = None
        self._changed = threading.Condition(self._lock)
        self.thread = threading.Thread(target=self._follow, name="weights", daemon=True)

    def _follow(self) -> None:
        w = self.cfg.weights
        run = store_run(self.cfg.run.name, self.cfg.rollout.weights_format)  # the format this engine loads
        for wv in subscribe(w.root, run, announce=self.announce, start=self.start, hold=True,
                            stop=self.stop, poll_s=self.poll_s, curve=self.curve, verify=w.verify):
            with self._changed:
                if self._newest is not None:
                    self._newest.close()  # superseded before the engine took it
                self._newest = wv
                self._changed.notify_all()

    def close(self) -> None:
        """Stop following and wake any `take` that is waiting."""
        with self._changed:
            self.stop.set()
            self._changed.notify_all()

    def take(self, at_least: int, timeout: float) -> WeightVersion | None:
        """The newest unloaded version if it is >= at_least, waiting up to `timeout` for one."""
        with self._changed:
            ok = self._changed.wait_for(lambda: self._newest is not None and self._newest.version >= at_least
                                        or self.stop.is_set(), timeout)
            if not ok or self._newest is None or self._newest.version < at_least:
                return None
            wv, self._newest = self._newest, None
            return wv


def announce_address(cfg: Config) -> str:
    """Where a rollout hears of new weight versions: the learner's PUB, or with `rollout.announce: relay` this
    node's relay PUB, which announces a version once it is in this node's store (the learner's announcement
    comes first, and the version would only be found by the store scan, up to `poll_s` after the relay)."""
    if cfg.rollout.announce == "relay":
        from offpolicy.relay.topology import local_announce

        return local_announce(cfg)
    return transport.tcp(learner_host(cfg), cfg.transport.announce_port)


class RolloutDaemon:
    def __init__(self, cfg: Config, index: int = 0):
        self.cfg, self.index = cfg, index
        self.daemon_id = f"rollout-{index}@{socket.gethostname()}:{os.getpid()}"
        self.m = RolloutMetrics()
        self._aborted_seen = 0  # engine.aborted already exported
        self.rate_log = RateLimitedLog(log)  # refusals and bad messages: a line per second per reason at most
        self.engine = make_engine(cfg, seed=cfg.rollout.seed + index)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.reward = get_reward(cfg.rollout.reward)
        r = cfg.rollout
        self.params = SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(r.stop_token_ids))
        self.leases: asyncio.Queue = asyncio.Queue()
        self.stop = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.welcome: protocol.Welcome | None = None
        self.refusal: str | None = None
        self.requested = False
        self.rejoining = False
        self.must_reload = False  # the engine's weights may be from a version the learner abandoned
        self.fatal = False
        self.busy = 0
        self.held: WeightVersion | None = None  # the version the engine holds, kept open until the next one

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
        self.announce = announce_address(self.cfg)
        self.follower = VersionFollower(self.cfg, self.announce, curve=self.curve)
        transport.install_stop_signals(self.stop)
        receiver = asyncio.create_task(self._receive())
        try:
            welcome = await self._join()
            if welcome is None:
                return 0 if self.stop.is_set() else 1  # SIGTERM before joining is a clean stop
            self.follower.thread.start()
            if welcome.newest_version >= 0:  # a late joiner starts from the newest version
                await self._swap(welcome.newest_version)
            tasks = [receiver, *(asyncio.create_task(c) for c in (self._heartbeat(), self._work()))]
            stopper = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            self.follower.close()
            for task in [stopper, *tasks]:
                task.cancel()
            await asyncio.gather(stopper, *tasks, return_exceptions=True)
            failed = [t for t in done if t is not stopper and not t.cancelled() and t.exception()]
            for t in failed:
                log.error("rollout daemon failed: %r", t.exception(), exc_info=t.exception())
            return 1 if failed or self.fatal else 0
        finally:
            receiver.cancel()
            self.follower.close()
            if self.held is not None:
                self.held.close()
            self.dealer.close(0)
            ctx.term()

    async def _join(self) -> protocol.Welcome | None:
        """Hello until Welcome (or a refusal, or transport.connect_timeout_s)."""
        t = self.cfg.transport
        self.welcome, self.refusal = None, None
        self.welcomed.clear()
        await transport.send(self.dealer, protocol.Hello(daemon_id=self.daemon_id, engine=self.cfg.rollout.engine,
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
        self.follower.close()  # versions past the learner's checkpoint were abandoned: follow afresh
        self.follower = VersionFollower(self.cfg, self.announce, start=max(welcome.newest_version, 0), curve=self.curve)
        self.follower.thread.start()
        self.must_reload = True
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
            t0 = time.perf_counter()
            lease, tokens = await self.leases.get()
            self.m.idle_seconds.inc(time.perf_counter() - t0)
            self.busy = len(lease.prompts)
            await self._request_work()  # prefetch the next lease while this one generates
            await self._swap(lease.min_version)
            await self._generate(lease, tokens)
            self.busy = 0

    async def _swap(self, min_version: int) -> None:
        """Load the newest version available; wait for one >= min_version if the engine is older."""
        have = -1 if self.must_reload else self.engine.version
        need = max(min_version, have + 1)
        wait = 0.0 if have >= min_version else self.cfg.transport.lease_timeout_s
        wv = await asyncio.to_thread(self.follower.take, need, wait)
        if wv is None:
            if have < min_version:
                raise RuntimeError(f"weight version {min_version} never appeared in {self.cfg.weights.root} (format "
                                   f"{self.cfg.rollout.weights_format}): is weights.root the learner's store on "
                                   "this node, and does the learner (or the relay) publish that format?")
            return
        swaps = getattr(self.engine, "swaps", None)  # engines that keep a record per load (vLLM)
        done = len(swaps) if swaps is not None else 0
        try:
            seconds = await asyncio.to_thread(self.engine.load, wv)
        except BaseException:
            wv.close()
            raise
        if self.held is not None:
            self.held.close()
        self.held = wv  # the loaded version stays readable: a restarted server is brought back to it
        for record in (swaps or [])[done:]:
            self.m.loads.labels(record["method"], str(record["verified"]).lower()).inc()
        self.must_reload = False
        self.m.load_seconds.observe(seconds)
        self.m.version.set(self.engine.version)
        log.info("loaded weight version %d (format %s) from %s in %.3fs", self.engine.version,
                 self.cfg.rollout.weights_format, wv.path, seconds)

    async def _generate(self, lease: protocol.Lease, tokens: np.ndarray) -> None:
        cuts = np.cumsum([p.n_tokens for p in lease.prompts])[:-1]
        prompts = [t.tolist() for t in np.split(tokens, cuts)]
        version = self.engine.version
        t0 = time.perf_counter()
        seeds = ([prompt_seed(self.cfg.rollout.seed, p.epoch, p.prompt_id) for p in lease.prompts]
                 if self.cfg.rollout.seed_per_prompt else None)
        groups = await asyncio.to_thread(self.engine.generate, prompts, self.params, seeds)
        seconds = time.perf_counter() - t0
        self.m.gen_seconds.observe(seconds)
        aborted = getattr(self.engine, "aborted", 0)  # engines that retry aborted samples count them
        self.m.aborted.inc(aborted - self._aborted_seen)
        self._aborted_seen = aborted
        rewards_all = []
        for p, ptoks, comps in zip(lease.prompts, prompts, groups):
            rewards = [float(self.reward(p.text, p.answer, self.tokenizer.decode(c.tokens))) for c in comps]
            rewards_all += rewards
            msg = protocol.SampleGroup(lease_id=lease.lease_id, prompt_id=p.prompt_id, epoch=p.epoch,
                                       weight_version=version, response_lengths=[len(c.tokens) for c in comps],
                                       rewards=rewards, finish_reasons=[c.finish_reason for c in comps],
                                       gen_seconds=seconds)
            await transport.send(self.dealer, msg, np.asarray(ptoks, dtype=protocol.TOKEN_DTYPE),
                                 np.concatenate([c.tokens for c in comps]),
                                 np.concatenate([c.logprobs for c in comps]))
            self.m.groups_sent.inc()
            self.m.samples.inc(len(comps))
            self.m.tokens.inc(sum(len(c.tokens) for c in comps))
        self.m.reward.set(float(np.mean(rewards_all)))
