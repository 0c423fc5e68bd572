"""Weight updates in flight on vLLM servers (rollout.inflight_updates over HTTP), as PipelineRL and AReaL do.

While a generate call runs, a `Switcher` thread watches for a newer version the servers were asked to stage
(`VLLMPrefetcher.asked_after`); once every server says its staging has ended (`offpolicy_ready`, between the server's
steps, never waiting), it switches them all (`ServerPool.update_weights(in_flight=True)` -> `VLLMServers.switch_on`):
pause with mode=keep (the requests stay, frozen), each request's count of sampled tokens (`offpolicy_progress`), the
load and its proof, the label, resume. The requests then go on with the new weights (the KV cache of their earlier
tokens stays, as in PipelineRL). Each token keeps the version that produced it:

- `runs_of(key, first, switches, length)`: a sample's runs from the counts (vLLM 0.26 keeps no labels): at each switch,
  the tokens it had sampled came from the versions before. A sample a switch did not find in the runner (finished
  before it, or still waiting, or preempted) is given no run there: its tokens are counted to the older version, never
  a newer one than produced them, so the staleness bound (the oldest token's) holds;
- where the server labels its outputs (vLLM 0.32's `weight_versions` spans), the spans are the runs (`span_runs`), and
  a sample's counts that disagree with them are counted (`Switcher.disagreements`, logged): they agree exactly on the
  CPU (tests/integration/test_vllm_engine.py, `check_inflight`).

A switch that fails (a load not proven, a server refusing) ends the generate call with the error once its requests
return: their tokens after the pause came from weights that are neither version.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from offpolicy.plumbing.trace import now
from offpolicy.rollout.engines.errors import EngineError, VersionMismatch
from offpolicy.rollout.engines.http_pool import HEALTH_TIMEOUT_S, ServerDown
from offpolicy.rollout.engines.vllm.progress import sample_key
from offpolicy.wire.protocol import VersionRun
from offpolicy.wire.versions import token_versions

log = logging.getLogger("offpolicy.vllm")

POLL_S = 0.05  # how often a generate call looks for a staged newer version (an RPC between steps only when one is)


@dataclass
class Switch:
    version: int
    progress: dict[tuple[str, int], int]  # (our request id, sample index) -> tokens it had sampled, over all servers
    seconds: float  # the switch's wall time (pause to resume, every server)


def runs_of(key: tuple[str, int], first: int, switches: list[Switch], length: int) -> list[VersionRun]:
    """The runs of the sample `key` (`length` tokens, begun on version `first`) from the counts of `switches`."""
    runs = [VersionRun(0, first)]
    for s in switches:
        n = s.progress.get(key)
        if n is None or n >= length:
            continue  # not in the runner at that switch, or done by then: no token of this version
        if n <= runs[-1].start:  # the run before produced nothing: this version takes its place
            runs[-1] = VersionRun(runs[-1].start, s.version)
        else:
            runs.append(VersionRun(n, s.version))
    return runs


def span_runs(spans: list[dict], known: set[int], where: str) -> list[VersionRun]:
    """The runs of vLLM 0.32's `weight_versions` spans ({version, start, end}); each label must be a version the
    engine loaded during the call (`known`), else another client changed the server's weights."""
    runs = []
    for span in spans:
        label = str(span.get("version"))
        if not label.lstrip("-").isdigit() or int(label) not in known:
            raise VersionMismatch(f"vLLM output {where} has tokens of weight version {label!r}, not one of "
                                  f"{sorted(known)} the engine loaded: is another client updating this server?")
        if not runs or int(label) != runs[-1].version:
            runs.append(VersionRun(int(span.get("start", 0)), int(label)))
    if not runs or runs[0].start != 0:
        raise EngineError(f"vLLM output {where}: weight version spans {spans} do not start at token 0")
    return runs


class Switcher:
    """Switches an HTTP `VLLMEngine`'s servers to newer staged versions while one generate call runs (a context)."""

    def __init__(self, engine):
        self.engine = engine
        self.began_on = engine.version
        self.switches: list[Switch] = []
        self.error: Exception | None = None
        self.compared = 0  # samples whose counts were checked against vLLM's labels (0.32)
        self.disagreements = 0  # ... and split them differently
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-inflight", daemon=True)

    def __enter__(self) -> Switcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()  # a switch under way ends first: its resume is sent

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            wv = self.engine.prefetcher.asked_after(self.engine.version)
            if wv is None or not self._ready(str(wv.path)):
                continue
            try:
                self._switch(wv)
            except Exception as e:  # raised by the generate call once its requests are back
                log.error("the weight update in flight to version %d failed: %s", wv.version, e)
                self.error = e
                return

    def _ready(self, path: str) -> bool:
        backend = self.engine.backend
        servers = [s for s in backend.servers if s.healthy and s.version == self.engine.version]
        try:
            return bool(servers) and all(r.get("ready") is True for s in servers
                                         for r in backend.rpc(s, "offpolicy_ready", {"path": path}, HEALTH_TIMEOUT_S))
        except (ServerDown, EngineError) as e:  # a server going down is the generate call's to handle
            log.debug("asking whether %s is staged: %s", path, e)
            return False

    def _switch(self, wv) -> None:
        engine, t0, began = self.engine, time.perf_counter(), now()
        engine.backend.update_weights(str(wv.path), wv.version, in_flight=True)
        engine.version, engine.path = wv.version, str(wv.path)
        records = engine.take_swaps(wv.version)
        progress: dict[tuple[str, int], int] = {}
        for r in records:
            progress.update(r.pop("progress", {}))
            r["inflight_at"] = began  # the daemon traces it as a load during the generation (`double_buffer.outcomes`)
        engine.switched.append((wv.version, records))
        self.switches.append(Switch(wv.version, progress, time.perf_counter() - t0))
        log.info("switched in flight to weight version %d in %.3f s: %d samples went on with it", wv.version,
                 self.switches[-1].seconds, sum(1 for n in progress.values() if n > 0))

    @property
    def loaded(self) -> set[int]:
        """Every version the call's tokens may carry."""
        return {self.began_on, *(s.version for s in self.switches)}

    def runs(self, out: dict, choice: dict, first: int, length: int, where: str) -> list[VersionRun]:
        """The runs of one parsed sample: its server's labels where it gives them, else the switches' counts."""
        key = sample_key(str(out.get("request_id", "")))
        sample = (key[0], int(choice.get("index", 0))) if key else None
        counted = runs_of(sample, first, self.switches, length) if sample else None
        spans = choice.get("weight_versions") or []
        if not spans:
            if counted is None and self.switches:
                raise EngineError(f"vLLM output {where}: request id {out.get('request_id')!r} is not one of ours")
            return counted or [VersionRun(0, first)]
        labelled = span_runs(spans, self.loaded, where)
        self.compared += counted is not None
        if counted is not None and counted != labelled and self._disagree(counted, labelled, sample, length):
            self.disagreements += 1
            log.warning("vLLM output %s: its labels split it as %s, the switches' counts as %s (labels kept)", where,
                        labelled, counted)
        return labelled

    def _disagree(self, counted: list[VersionRun], labelled: list[VersionRun], sample: tuple[str, int],
                  length: int) -> bool:
        """Whether the counts are wrong: a token counted to a newer version than produced it, or any difference for a
        sample every switch found in the runner (one a switch missed is left on the older version, by design)."""
        newer = (token_versions(counted, length) > token_versions(labelled, length)).any()
        return bool(newer) or all(sample in s.progress for s in self.switches)
