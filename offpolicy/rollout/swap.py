"""A rollout's weights: follow the published versions, load the newest between leases, hold the loaded one.

`VersionFollower` follows versions in a background thread through the public `offpolicy.weights.subscribe`
API (announcements on `announce_address`, store scans as the fallback) and holds the newest one not yet
loaded. `WeightSwapper.swap(min_version)` loads the newest available version into the engine, waiting up
to `transport.lease_timeout_s` for one >= `min_version` when the engine is older (an error naming
weights.root and the format if it never comes); the loaded version stays open (readable) until the next
one is loaded, so a restarted inference server can be brought back to it. After the learner restarted,
`restart` follows afresh from its newest version and forces a reload (versions past its checkpoint were
abandoned).

With an engine that double-buffers (`rollout.double_buffer`, `engines.prefetcher_of`), the follower hands
every version it holds to the engine's prefetcher the moment it arrives (and, after each swap, the newest
one not yet loaded again: the spare then holds the old version), so the read runs while the engine
generates; `swap` is unchanged (the same versions at the same points, between leases, never below
`min_version`), only `engine.load` is shorter: `offpolicy_weight_load_seconds` is what stays on the critical
path, `offpolicy_weight_prefetch_seconds` the background read of each version swapped in. A version whose
read failed (`VersionRefused`: the engine's weights untouched) is skipped with an error while the version the
engine holds still satisfies the lease, else the swap fails as any failed load does.

With `rollout.inflight_updates` the engine also swaps in a version the prefetcher has ready between decode steps
of a generation; `swap` first takes note of such switches (`adopt_inflight`): each is traced as a `load` span
(`inflight`), the newest becomes the version held, and the next read is asked for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from offpolicy.config import Config, learner_host
from offpolicy.plumbing.metrics import RolloutMetrics
from offpolicy.plumbing.trace import Tracer, now
from offpolicy.rollout.engines import Prefetcher
from offpolicy.rollout.engines.errors import VersionRefused
from offpolicy.weights import WeightVersion, subscribe
from offpolicy.weights.formats import store_run
from offpolicy.wire import transport
from offpolicy.wire.keys import CurveClient

log = logging.getLogger("offpolicy.rollout")


class VersionFollower:
    """Follows weight versions in a thread via `subscribe`; holds the newest one not yet loaded."""

    def __init__(self, cfg: Config, announce: str, start: int = 0, curve: CurveClient | None = None,
                 poll_s: float = 0.25, on_version: Callable[[WeightVersion], None] | None = None):
        self.cfg, self.announce, self.start, self.curve = cfg, announce, start, curve
        self.on_version = on_version  # told of each version held (a prefetcher); must return at once
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
                if self.on_version is not None:
                    self.on_version(wv)
                self._changed.notify_all()

    def take_through(self, version: int) -> WeightVersion | None:
        """The newest unloaded version if it is <= `version` (the engine switched to it in flight), else None."""
        with self._changed:
            if self._newest is None or self._newest.version > version:
                return None
            wv, self._newest = self._newest, None
            return wv

    def offer_newest(self) -> None:
        """Tell `on_version` again of the newest version held and not yet taken, if any."""
        with self._changed:
            if self._newest is not None and self.on_version is not None:
                self.on_version(self._newest)

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


class WeightSwapper:
    """The engine's weight version: a `VersionFollower` and the loaded version, held open."""

    def __init__(self, cfg: Config, engine, metrics: RolloutMetrics, announce: str, tracer: Tracer,
                 curve: CurveClient | None = None, prefetcher: Prefetcher | None = None):
        self.cfg, self.engine, self.m, self.announce, self.curve = cfg, engine, metrics, announce, curve
        self.tracer = tracer
        self.prefetcher = prefetcher  # the engine's background loader (rollout.double_buffer), or None
        self.follower = self._follower(0)
        self.must_reload = False  # the engine's weights may be from a version the learner abandoned
        self.held: WeightVersion | None = None  # the version the engine holds, kept open until the next one

    def start(self) -> None:
        self.follower.thread.start()

    def _follower(self, start: int) -> VersionFollower:
        on_version = self.prefetcher.prefetch if self.prefetcher is not None else None
        return VersionFollower(self.cfg, self.announce, start=start, curve=self.curve, on_version=on_version)

    def restart(self, start: int) -> None:
        """The learner restarted: follow afresh from version `start` and load again before the next lease."""
        self.follower.close()  # versions past the learner's checkpoint were abandoned: follow afresh
        self.follower = self._follower(start)
        self.follower.thread.start()
        self.must_reload = True

    def stop(self) -> None:
        """Stop following (wakes a waiting swap)."""
        self.follower.close()

    def close(self) -> None:
        self.follower.close()
        if self.held is not None:
            self.held.close()

    def adopt_inflight(self) -> None:
        """Take note of the versions the engine switched to between decode steps since the last call (rollout.
        inflight_updates): record them, hold the newest one's files, and ask for the next read into the spare."""
        if self.prefetcher is None or self.held is None or self.engine.version <= self.held.version:
            return
        self._prefetched()
        wv = self.follower.take_through(self.engine.version)
        if wv is not None:
            self.held.close()
            self.held = wv
        self.m.version.set(self.engine.version)
        self.follower.offer_newest()  # the spare holds the old version now: read the next one into it

    async def swap(self, min_version: int) -> None:
        """Load the newest version available; wait for one >= min_version if the engine is older."""
        self.adopt_inflight()
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
        began = now()
        try:
            seconds = await asyncio.to_thread(self.engine.load, wv)
        except VersionRefused as e:  # the engine's weights are untouched: its version may still do
            wv.close()
            self._prefetched()
            if have < min_version:
                raise
            log.error("weight version %d refused, version %d keeps serving (the lease needs >= %d): %s",
                      wv.version, have, min_version, e)
            return
        except BaseException:
            wv.close()
            raise
        if self.held is not None:
            self.held.close()
        self.held = wv  # the loaded version stays readable: a restarted server is brought back to it
        staged = {"host": 0, "device": 0}
        for record in self.engine.last_loads:  # one per server (an embedded engine has none)
            self.m.loads.labels(record["method"], str(record["verified"]).lower()).inc()
            if "staged" in record:  # vLLM: the version staged for its reload (rollout.vllm.prefetch)
                staged[record["staged"]["where"]] += record["staged"]["bytes"]
        for where, n in staged.items():
            self.m.staged_bytes.labels(where).set(n)
        self.must_reload = False
        self.m.load_seconds.observe(seconds)
        self.m.version.set(self.engine.version)
        self.tracer.add("load", began, now() - began, version=self.engine.version)
        background = self._prefetched()
        log.info("loaded weight version %d (format %s) from %s in %.3fs%s", self.engine.version,
                 self.cfg.rollout.weights_format, wv.path, seconds,
                 f" (read in the background in {background:.3f}s)" if background is not None else "")
        if self.prefetcher is not None:
            self.follower.offer_newest()  # the spare now holds the old version: read the next one into it

    def _prefetched(self) -> float | None:
        """Record the prefetcher's finished requests; the background seconds of the version just swapped in."""
        if self.prefetcher is None:
            return None
        swapped = None
        for r in self.prefetcher.drain():
            self.m.prefetches.labels(r.outcome).inc()
            if r.outcome == "swapped":
                self.m.prefetch_seconds.observe(r.seconds)
                cpu = {} if r.cpu_seconds is None else {"cpu_seconds": round(r.cpu_seconds, 4)}
                self.tracer.add("prefetch", r.began, r.seconds, lane="prefetch", version=r.version, **cpu)
                swapped = r.seconds
            if r.inflight:  # swapped in during a generation: what it held the generation for (0: a pointer swap)
                self.m.load_seconds.observe(r.swap_seconds)
                for method, proven in r.proofs:
                    self.m.loads.labels(method, str(proven).lower()).inc()
                self.tracer.add("load", r.swapped_at, r.swap_seconds, version=r.version, inflight=True)
                log.info("switched to weight version %d in flight (during a generation, %.3f s; %s)", r.version,
                         r.swap_seconds, f"read in the background in {r.seconds:.3f}s" if r.outcome == "swapped"
                         else "nothing read ahead: the switch read it")
        return swapped
