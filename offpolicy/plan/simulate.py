"""Discrete-event simulation of the one-step-off pipeline under the hub's real admission rules.

The simulated hub holds the project's own `StalenessGate`, `Batcher`, `PromptCursor` and `LeaseBook`
and calls `admission.drop_stale` / `admission.give_back` exactly where offpolicy/hub/hub.py does, so the
simulation admits, leases, drops and trains what the real hub would; only time is simulated:
- the learner (offpolicy/learner/loop.py `train` and `Announcer`): publish version 0; per step wait for a
  batch (`drop_stale`, then `Batcher.take`), train (work on its resource), then publish version k+1: wait for
  the version still being written (at most one in flight), snapshot (`stall_s`), and with `overlap_publish`
  go on to the next step while the version is written (`publish_s`) in the background; it is announced (the
  gate opens, standing work requests are served) once written. A step that trains while a version is
  written takes `slowdown` x the seconds they overlap longer (`versions.slowed_train_s`). Without
  `overlap_publish` the learner waits for the write (weights.overlap_publish false; every run before the sharded
  publish);
- each rollout daemon (offpolicy/rollout/daemon.py `_work`): keeps `1 + prefetch_leases` leases requested or
  held, swaps to the newest version its node has before a lease (waiting for `min_version` if it
  has none that new; a load is a stall, or with `prefetch` (the torch engine's double buffer, a server's staging)
  a read that starts when the version reaches the node, in the background, so the swap waits only for what is left,
  then `swap_s` (a server taking the staged tensors; 0 for the torch engine's pointer swap)),
  generates the lease (work on its resource, so daemons and a learner that share GPUs or cores slow each
  other: `events.Shared`), sends its groups;
- the first `fresh_versions` versions (written into fresh pages: versions.FRESH_VERSIONS) take
  `fresh_publish_s` to write and each server's `fresh_load_s` to load;
- versions reach a node `relay_s(node)` after the announcement (0 on the learner's node).
Part times come in as numbers and functions (`costs.py` builds them); the result is per-step records
and per-daemon busy intervals, reduced by `SimResult.summary`. Deterministic for a given seed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from offpolicy.hub.admission import Batcher, StalenessGate, drop_stale, give_back
from offpolicy.hub.batch import Group
from offpolicy.hub.leases import LeaseBook, PromptCursor, PromptRef
from offpolicy.plan.events import Clock, Shared
from offpolicy.plan.versions import slowed_train_s

LeaseFn = Callable[[np.random.Generator, int], tuple[float, list[int]]]  # (rng, groups) -> (work s, tokens per group)


@dataclass(frozen=True)
class ServerModel:
    lease: LeaseFn  # one lease's generation: work seconds at full speed and tokens per group
    resource: str  # the Shared resource it generates on
    node: int = 0  # its node's place in the relay chain (0 = the learner's node)
    load_s: float = 0.0  # seconds to load a new version (a stall, or a background read with `prefetch`)
    prefetch: bool = False  # read each version as it reaches the node, while generating (rollout.double_buffer)
    fresh_load_s: float | None = None  # load of the first PipelineModel.fresh_versions versions (None: load_s)
    swap_s: float = 0.0  # after the read (staged loads): the swap of the staged tensors into the server, a stall

    def load_of(self, version: int, fresh_versions: int) -> float:
        return self.fresh_load_s if self.fresh_load_s is not None and version < fresh_versions else self.load_s


@dataclass(frozen=True)
class PipelineModel:
    batch_groups: int
    max_staleness: int
    servers: tuple[ServerModel, ...]
    train_s: Callable[[int], float]  # the batch's tokens -> learner work seconds at full speed
    publish_s: float  # writing one version (after the snapshot): in the background with overlap_publish
    resources: dict[str, float]  # name -> capacity (GPUs or cores)
    learner_resources: tuple[str, ...]  # where a step trains: one job on each (all GPUs in lockstep), done when all are
    groups_per_lease: int = 8
    prefetch_leases: int = 1
    relay_s: Callable[[int], float] = lambda node: 0.0  # seconds from announcement to the version on `node`
    hub_s_per_group: float = 0.0  # the hub's receive cost of one group (delays its arrival)
    background: dict[str, float] = field(default_factory=dict)  # resource -> other runnable tasks always there
    stall_s: float = 0.0  # the learner's snapshot of a version (its stall, weights.overlap_publish)
    overlap_publish: bool = True  # False: the learner waits for each write (weights.overlap_publish false)
    slowdown: float = 0.0  # learner.publish_slowdown: a step overlapping a write takes this x the overlap longer
    fresh_versions: int = 0  # the first versions, written into fresh pages (versions.FRESH_VERSIONS)
    fresh_publish_s: float | None = None  # their write (None: publish_s)

    def publish_of(self, version: int) -> float:
        fresh = self.fresh_publish_s is not None and version < self.fresh_versions
        return self.fresh_publish_s if fresh else self.publish_s


@dataclass
class StepRecord:
    step: int
    start: float
    waited: float
    train: float
    publish: float  # seconds the learner spent publishing: waiting for the version before, the snapshot (the write too
    #                 without overlap_publish)
    end: float
    tokens: int
    staleness: list[int]


@dataclass
class SimResult:
    steps: list[StepRecord]
    leases: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each generation
    busy: list[list[tuple[float, float]]] = field(default_factory=list)  # per daemon: generating or loading
    dropped_stale: int = 0

    def summary(self, warmup: int, period: int = 1) -> dict[str, float]:
        """Means over the steps after `warmup` (the span starts where step warmup - 1 ended). `period`: at
        max_staleness k steps can end in bursts of k + 1 (a version's chain per k + 1 steps), so a span of whole
        periods is kept: a few more leading steps are left out."""
        if len(self.steps) < warmup + 2:
            raise ValueError(f"{len(self.steps)} steps simulated; need more than warmup + 1 = {warmup + 1}")
        if len(self.steps) - warmup >= 2 * period:
            warmup += (len(self.steps) - warmup) % period
        kept = self.steps[warmup:]
        t0, t1 = (self.steps[warmup - 1].end if warmup else 0.0), kept[-1].end
        span = t1 - t0
        gens = sorted(e - s for s, e in self.leases if t0 <= s < t1) or [0.0]
        # G: generation seconds per step and daemon (bench/pipeline.py's), from the generations inside the span
        gen_busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.leases) / max(1, len(self.busy))
        busy = [sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in b) for b in self.busy]
        return {
            "step_s": span / len(kept), "tokens_per_s": sum(r.tokens for r in kept) / span,
            "steps_per_hour": 3600 * len(kept) / span,
            "learner_idle": sum(r.waited for r in kept) / span,
            "rollout_idle": max(0.0, 1 - sum(busy) / (span * len(busy))) if busy else 0.0,
            "train_s": sum(r.train for r in kept) / len(kept), "stall_s": sum(r.publish for r in kept) / len(kept),
            "gen_busy_s": gen_busy / len(kept),
            "wait_s": sum(r.waited for r in kept) / len(kept),
            "lease_s": sum(gens) / len(gens), "lease_p90_s": gens[min(len(gens) - 1, int(0.9 * len(gens)))],
            "lease_max_s": gens[-1], "staleness_mean": float(np.mean([s for r in kept for s in r.staleness])),
            "dropped_stale": self.dropped_stale,
        }


@dataclass
class _Lease:
    lease_id: int
    min_version: int
    refs: list[PromptRef]


class _Server:
    def __init__(self, sim: Simulation, index: int, model: ServerModel):
        self.sim, self.index, self.m = sim, index, model
        self.version = -1
        self.queue: deque[_Lease] = deque()
        self.busy = False
        self.requested = False
        self.waiting: _Lease | None = None  # a lease waiting for its min_version to reach the node
        self.intervals: list[tuple[float, float]] = []
        self.ready: dict[int, float] = {}  # prefetch: version -> when its background read ends
        self.read_until = 0.0  # prefetch: when the reader is free
        self.queued: tuple[int, float] | None = None  # prefetch: the last read asked for, (version, its start)

    def request_work(self) -> None:
        held = len(self.queue) + (1 if self.busy else 0)
        if not self.requested and held < 1 + self.sim.model.prefetch_leases:
            self.requested = True
            self.sim.clock.after(0.0, lambda: self.sim.hub_request(self, self.sim.model.groups_per_lease))

    def on_lease(self, lease: _Lease) -> None:
        self.requested = False
        self.queue.append(lease)
        self.work()

    def work(self) -> None:
        if self.busy or not self.queue:
            self.request_work()
            return
        lease = self.queue.popleft()
        self.busy = True
        self.request_work()  # prefetch the next lease while this one generates
        self.swap(lease)

    def swap(self, lease: _Lease) -> None:
        newest = self.sim.available[self.m.node]
        if newest >= max(lease.min_version, self.version + 1):
            self._load(newest, lease)
        elif self.version >= lease.min_version:
            self.generate(lease)
        else:
            self.waiting = lease  # woken by Simulation.make_available

    def prefetch(self, version: int) -> None:
        """A version reached the node: read it into the spare weights after the read going on (a read not begun
        yet is superseded by the newer version, as the double buffer does)."""
        if not self.m.prefetch:
            return
        now = self.sim.clock.now
        if self.queued is not None and self.queued[1] > now:
            self.ready.pop(self.queued[0], None)
            self.read_until = self.queued[1]
        begin = max(now, self.read_until)
        self.read_until = self.ready[version] = begin + self.m.load_of(version, self.sim.model.fresh_versions)
        self.queued = (version, begin)

    def _load(self, version: int, lease: _Lease) -> None:
        t = self.sim.clock.now
        full = self.m.load_of(version, self.sim.model.fresh_versions)
        stall = (max(0.0, self.ready[version] - t) if self.m.prefetch and version in self.ready else full) + self.m.swap_s
        self.intervals.append((t, t + stall))

        def loaded() -> None:
            self.version = version
            self.generate(lease)

        self.sim.clock.after(stall, loaded)

    def wake(self) -> None:
        if self.waiting is not None and self.sim.available[self.m.node] >= self.waiting.min_version:
            lease, self.waiting = self.waiting, None
            self._load(self.sim.available[self.m.node], lease)

    def generate(self, lease: _Lease) -> None:
        work, tokens = self.m.lease(self.sim.rng, len(lease.refs))
        start, version = self.sim.clock.now, self.version
        slot = len(self.intervals)
        self.intervals.append((start, math.inf))  # still generating (counted as busy up to any time)

        def done() -> None:
            now = self.sim.clock.now
            self.intervals[slot] = (start, now)
            self.sim.leases.append((start, now))
            for i, (ref, tok) in enumerate(zip(lease.refs, tokens)):
                self.sim.clock.after(self.sim.model.hub_s_per_group * (i + 1),
                                     lambda r=ref, t=tok: self.sim.hub_take(lease.lease_id, r, version, t))
            self.busy = False
            self.work()

        self.sim.resources[self.m.resource].start(work, done)


class Simulation:
    def __init__(self, model: PipelineModel, steps: int, seed: int = 0):
        self.model, self.total_steps = model, steps
        self.clock = Clock()
        self.rng = np.random.default_rng(seed)
        self.resources = {name: Shared(self.clock, cap, name, model.background.get(name, 0.0))
                          for name, cap in model.resources.items()}
        self.gate = StalenessGate(model.batch_groups, model.max_staleness)
        self.batcher = Batcher(self.gate)
        self.cursor = PromptCursor(1 << 30, shuffle=False)
        self.book = LeaseBook()
        self.newest = -1
        self.requests: dict[_Server, int] = {}
        nodes = 1 + max((s.node for s in model.servers), default=0)
        self.available = [-1] * nodes
        self.servers = [_Server(self, i, s) for i, s in enumerate(model.servers)]
        self.tokens: dict[PromptRef, int] = {}
        self.leases: list[tuple[float, float]] = []
        self.records: list[StepRecord] = []
        self.dropped = 0
        self.step = 0
        self.waiting_since: float | None = None
        self.write_end = 0.0  # when the version being written is complete

    # -- hub (offpolicy/hub/hub.py) ------------------------------------------------------------------
    def hub_request(self, server: _Server, credits: int) -> None:
        self.requests[server] = credits
        self.hub_serve()

    def hub_serve(self) -> None:
        for server in list(self.requests):
            room = min(self.requests[server], self.gate.capacity())
            if room <= 0:
                continue
            if self.newest < 0:
                return  # nothing published yet
            del self.requests[server]
            refs = self.cursor.take(room)
            self.gate.admit(len(refs))
            rec = self.book.issue(str(server.index), refs, self.newest, math.inf)
            lease = _Lease(rec.lease_id, rec.min_version, refs)
            self.clock.after(0.0, lambda s=server, x=lease: s.on_lease(x))  # a message: handled after this pass

    def hub_take(self, lease_id: int, ref: PromptRef, version: int, tokens: int) -> None:
        status, settled = self.book.settle(lease_id, ref.prompt_id, ref.epoch)
        if status != "ok":
            raise RuntimeError(f"simulated group refused: {status}")  # cannot happen without expiries
        if not self.gate.usable(version, self.gate.version):  # too stale on arrival: regenerate it
            give_back(self.cursor, self.gate, [settled])
            self.dropped += 1
            self.hub_serve()
            return
        self.book.mark_accepted(settled)
        self.tokens[settled] = tokens
        self.batcher.add(Group(prompt_id=ref.prompt_id, epoch=ref.epoch, lease_id=lease_id, weight_version=version,
                               prompt=np.empty(0, np.int32), responses=[], logprobs=[], rewards=np.empty(0),
                               finish_reasons=[]))
        self.learner_try()

    # -- learner (offpolicy/learner/loop.py) ----------------------------------------------------------
    def learner_try(self) -> None:
        if self.waiting_since is None or self.step >= self.total_steps:
            return
        stale = drop_stale(self.batcher, self.book, self.cursor, self.step)
        if stale:
            self.dropped += len(stale)
            self.hub_serve()
        batch = self.batcher.take(self.step)
        if batch is None:
            return
        start, self.waiting_since = self.waiting_since, None
        waited = self.clock.now - start
        tokens = sum(self.tokens.pop(PromptRef(g.epoch, g.prompt_id)) for g in batch)
        staleness = [self.step - g.weight_version for g in batch]
        t_train = self.clock.now
        parts = len(self.model.learner_resources)
        m = self.model

        def finish(t_pub: float) -> None:
            now = self.clock.now
            self.records.append(StepRecord(self.step, start, waited, t_pub - t_train, now - t_pub, now, tokens,
                                           staleness))
            self.step += 1
            self.waiting_since = now
            self.learner_try()

        left = [parts]

        def trained() -> None:
            left[0] -= 1
            if left[0]:
                return
            now, version = self.clock.now, self.step + 1
            snap = max(0.0, self.write_end - now) + m.stall_s  # the version before must be written first
            write = m.publish_of(version)
            self.write_end = now + snap + write
            if m.overlap_publish:
                self.clock.after(snap, lambda: finish(now))
                self.clock.after(snap + write, lambda: self.announce(version))
            else:
                self.clock.after(snap + write, lambda: (finish(now), self.announce(version)))

        work = slowed_train_s(m.train_s(tokens), self.write_end - t_train, m.slowdown)
        for name in m.learner_resources:
            self.resources[name].start(work, trained)

    def announce(self, version: int) -> None:
        self.newest = version
        self.gate.version = version
        for node in range(len(self.available)):
            self.clock.after(self.model.relay_s(node), lambda n=node, v=version: self.make_available(n, v))
        self.hub_serve()
        self.learner_try()

    def make_available(self, node: int, version: int) -> None:
        if version > self.available[node]:
            self.available[node] = version
            for s in self.servers:
                if s.m.node == node:
                    s.prefetch(version)
                    s.wake()

    def run(self) -> SimResult:
        def first() -> None:  # version 0, published before any rollout starts
            self.waiting_since = self.clock.now
            self.announce(0)

        self.write_end = self.model.publish_of(0)
        self.clock.after(self.write_end, first)
        for s in self.servers:
            s.request_work()
        self.clock.run(until=lambda: self.step >= self.total_steps)
        if self.step < self.total_steps:
            raise RuntimeError(f"the simulated pipeline stalled at step {self.step} (no event left): "
                               "check batch_groups, groups_per_lease and max_staleness")
        return SimResult(self.records, self.leases, [s.intervals for s in self.servers], self.dropped)


def simulate(model: PipelineModel, steps: int = 20, seed: int = 0) -> SimResult:
    """Run `steps` learner steps of `model`; per-step records and busy intervals."""
    return Simulation(model, steps, seed).run()
