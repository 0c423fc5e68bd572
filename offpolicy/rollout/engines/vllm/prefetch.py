"""`VLLMPrefetcher`: the vLLM engine's half of `rollout.double_buffer` (the `engines.Prefetcher` protocol).

A vLLM server cannot swap in a second set of the weights its CUDA graphs read, but it can read the next version ahead
and hash it: each worker stages the version in host or device memory (`rollout.vllm.prefetch`, `staging.py`), or only
hashes its files (`hash`), in the background (`worker.Extension.offpolicy_prefetch`). The rollout daemon hands the
prefetcher every version it hears of; the prefetcher asks every healthy server to stage that version (one request at
a time, in its own thread: `prefetch` returns at once, and a newer version replaces one not yet asked for), and the
servers go on generating meanwhile. The version's load then takes the staged tensors and their hash instead of reading
the files (`prefetch_seconds` and `staged` in its report). `drain` tells the daemon what became of each
version: `swapped` (a load used it; the background seconds), `superseded` (a newer one was loaded first), `failed`
(a server refused the request; the load hashes the files itself then) or `unstaged` (switched to in flight with
nothing read ahead: `prefetch: direct`, whose versions are ready at once). Over HTTP only: `vllm.LLM` in this process
takes no calls from a second thread."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from offpolicy.rollout.engines.double_buffer import PrefetchRecord, switch_outcomes
from offpolicy.weights import WeightVersion

log = logging.getLogger("offpolicy.vllm")


class VLLMPrefetcher:
    def __init__(self, engine):
        self.engine = engine  # a VLLMEngine over HTTP: its `backend` (VLLMServers) and `last_loads`
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-prefetch")
        self._lock = threading.Lock()
        self._next: WeightVersion | None = None  # the newest version not yet asked for
        self._asked: set[int] = set()  # versions the servers were asked to hash, not yet loaded or superseded
        self._newest_asked: WeightVersion | None = None  # the newest of them (an update in flight may switch to it)
        self._failed: list[PrefetchRecord] = []

    def prefetch(self, weights: WeightVersion) -> None:
        with self._lock:
            if weights.version in self._asked or (self._next is not None and self._next.version == weights.version):
                return  # asked already (the daemon offers the newest version again after each load)
            if self._next is not None:
                self._failed.append(PrefetchRecord(self._next.version, "superseded"))
            self._next = weights
        self._pool.submit(self._ask)

    def _ask(self) -> None:
        with self._lock:
            weights, self._next = self._next, None
        if weights is None:  # a later request took it
            return
        servers = self.engine.backend
        t = servers.cfg.update_timeout_s
        for s in [s for s in servers.servers if s.healthy]:
            try:
                servers.rpc(s, "offpolicy_prefetch", {"path": str(weights.path), "stage": servers.cfg.prefetch,
                                                      "maps": servers.maps, "threads": servers.cfg.stage_threads}, t)
            except Exception as e:  # the load hashes the files itself
                log.warning("%s: could not start staging version %d ahead (%s); its load reads it", s.url,
                            weights.version, e)
                with self._lock:
                    self._failed.append(PrefetchRecord(weights.version, "failed", error=str(e)))
                return
        with self._lock:
            self._asked.add(weights.version)
            if self._newest_asked is None or weights.version > self._newest_asked.version:
                self._newest_asked = weights

    def asked_after(self, version: int) -> WeightVersion | None:
        """The newest version every server was asked to stage, if newer than `version` (rollout.inflight_updates:
        `inflight.Switcher` switches to it once the servers say it is staged)."""
        with self._lock:
            wv = self._newest_asked
        return wv if wv is not None and wv.version > version else None

    def drain(self) -> list[PrefetchRecord]:
        """After a load: `swapped` for the version it loaded if every server took its files' hash from the background,
        `superseded` for older versions asked for, and the requests that failed. Each version switched to in flight
        since the last drain is `swapped` (or `unstaged`) from its own switch's records (`engine.switched`), not
        superseded by the newest."""
        with self._lock:
            out, self._failed = self._failed, []
            return out + switch_outcomes(self._asked, self.engine)

    def asked(self, timeout: float) -> None:
        """Wait (up to `timeout` s) until the servers were asked for every version handed to `prefetch` so far: their
        staging is then under way (benchmarks and tests, which time what runs beside it)."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
