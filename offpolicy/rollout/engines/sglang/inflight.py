"""Weight updates in flight on SGLang servers (rollout.inflight_updates over HTTP), as AReaL does.

The rollout daemon hands the engine's `Announcer` every version it hears of (nothing is read ahead: SGLang's
`update_weights_from_disk` reads the files itself). While a generate call runs, `InFlight` looks for a newer version
every `POLL_S` and switches the servers to it at once (`SGLangServers.switch_on`), by rollout.sglang.inflight_switch:
`abort_all` (the default) = the update alone, with `abort_all_requests`: SGLang aborts every running request, which
returns with the tokens it has sampled, and its update lock waits for them and holds new requests until the update is
done, then the proof; `pause` = pause with mode `abort`, which ends the running requests the same way and returns once
none runs (SGLang polls for that once a second), then the update (its cache flushed), continue, and the proof. The
aborted samples go on as continuations: the prompt plus the tokens sampled so far, with what is left of
`max_new_tokens`, on the new version (SGLang prefills them again under the new weights, unlike
vLLM's switch, which keeps the old KV cache). Each token keeps the version that produced it:

- every answer of an attempt carries SGLang's `weight_version`, set when the answer is made: an aborted answer is made
  before the update (the pause, or the update's lock, waits for it), a request sent during the switch waits in SGLang
  until the update is done and is answered on the new version (with `abort_all`, a request that took the lock's read
  side before the update queued and reached SGLang's scheduler after the abort is not aborted: it finishes on the old
  version, labelled so, and the update waits for it); so the label of each answer is the version of all its tokens,
  and it must be a version the engine loaded during the call, else another client changed the server's weights
  (`VersionMismatch`);
- a sample's pieces join into one completion whose `version_runs` say where each version's tokens begin; its
  behaviour logprobs are each piece's own, as SGLang sampled them;
- a piece that ends on a stop token, or fills `max_new_tokens`, ends the sample even if SGLang answered it aborted.

Samples SGLang aborts without a switch are sent on the same way, at most rollout.sglang.max_retries times
(`RetriesExhausted` after that). A switch that fails (an update refused, a load not proven) ends the generate call with
its error once the aborted requests are back: no piece is sent to weights that are neither version. With
rollout.seed_per_prompt a continuation keeps its sample's seed, so a switched sample is not the one an unswitched call
would have sampled from the same seed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Pending
from dataclasses import dataclass, field

import numpy as np

from offpolicy.plumbing.trace import now
from offpolicy.rollout.engines import Completion, SamplingParams, request_stops
from offpolicy.rollout.engines.double_buffer import PrefetchRecord, switch_outcomes
from offpolicy.rollout.engines.sglang.wire import (
    RetriesExhausted,
    VersionMismatch,
    abort_message,
    answer_meta,
    finish_type,
    parse_output,
    partial_output,
    samples_sampling,
    weight_label,
)
from offpolicy.weights import WeightVersion
from offpolicy.wire.protocol import VersionRun

log = logging.getLogger("offpolicy.sglang")

POLL_S = 0.05  # how often a generate call looks for a newer version announced


class Announcer:
    """The `engines.Prefetcher` of SGLang servers over HTTP with rollout.inflight_updates: it only keeps the newest
    version the daemon heard of (`asked_after`), for `InFlight` to switch to; `drain` reports each switch (`unstaged`:
    nothing was read ahead) and forgets versions a load between calls took."""

    def __init__(self, engine):
        self.engine = engine  # an SGLangEngine over HTTP: its `version`, `switched` and `last_loads`
        self._lock = threading.Lock()
        self._newest: WeightVersion | None = None
        self._asked: set[int] = set()

    def prefetch(self, weights: WeightVersion) -> None:
        with self._lock:
            self._asked.add(weights.version)
            if self._newest is None or weights.version > self._newest.version:
                self._newest = weights

    def asked_after(self, version: int) -> WeightVersion | None:
        """The newest version announced, if newer than `version`."""
        with self._lock:
            wv = self._newest
        return wv if wv is not None and wv.version > version else None

    def drain(self) -> list[PrefetchRecord]:
        with self._lock:
            return switch_outcomes(self._asked, self.engine)

    def close(self) -> None:
        pass


@dataclass
class Sample:
    """One sample of a generate call, in pieces: the tokens and logprobs of each answer and the version of each."""
    prompt: list[int]
    sampling: dict
    tokens: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    runs: list[VersionRun] = field(default_factory=list)
    meta: dict | None = None  # the first answer's (its prefill counts: the prompt's)
    finish: str | None = None

    @property
    def length(self) -> int:
        return sum(len(t) for t in self.tokens)

    def request(self) -> tuple[list[int], dict]:
        """The row and sampling params that go on from where the sample is: the prompt plus its tokens so far."""
        so_far = [int(t) for piece in self.tokens for t in piece]
        return self.prompt + so_far, {**self.sampling, "max_new_tokens": self.sampling["max_new_tokens"] - len(so_far)}

    def add(self, tokens: np.ndarray, logprobs: np.ndarray, version: int) -> None:
        if len(tokens) and (not self.runs or self.runs[-1].version != version):
            self.runs.append(VersionRun(self.length, version))
        self.tokens.append(tokens)
        self.logprobs.append(logprobs)

    def ended(self, stops: set[int]) -> str | None:
        """How an aborted sample ended anyway: on a stop token, or at max_new_tokens; None: it goes on."""
        if self.length and int(self.tokens[-1][-1]) in stops:
            return "stop"
        return "length" if self.length >= self.sampling["max_new_tokens"] else None

    def completion(self) -> Completion:
        return Completion(tokens=np.concatenate(self.tokens).astype(np.int32),
                          logprobs=np.concatenate(self.logprobs).astype(np.float32), finish_reason=self.finish or "",
                          meta=dict(self.meta or {}), version_runs=list(self.runs))


class InFlight:
    """The generate calls of an `SGLangEngine` over HTTP whose servers switch to newer versions meanwhile."""

    def __init__(self, engine, announcer: Announcer):
        self.engine, self.announcer = engine, announcer
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-inflight")

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None) -> list[list[Completion]]:
        e = self.engine
        stops = request_stops(e.stop_ids, params, prompts, seeds)
        stop_set = set(stops)
        samples = [Sample(list(prompts[k // params.n]), sp)
                   for k, sp in enumerate(samples_sampling(params, stops, len(prompts), seeds))]
        loaded, todo, group, retries = {e.version}, list(range(len(samples))), params.n, 0
        while todo:
            sent = [samples[i].request() for i in todo]
            outs, switched = self._attempt([r for r, _ in sent], [sp for _, sp in sent], group, loaded)
            aborted = []
            for i, out in zip(todo, outs):
                self._answer(samples[i], out, loaded, stops, stop_set)
                if samples[i].finish is None:
                    aborted.append((i, out))
            if aborted and not switched:
                e.aborted += len(aborted)
                retries += 1
                if retries > e.max_retries:
                    raise RetriesExhausted(f"SGLang aborted {len(aborted)} samples {retries} times (last: "
                                           f"{abort_message(aborted[0][1])}); raise rollout.sglang.max_retries or "
                                           "look at the servers' logs")
                log.warning("SGLang aborted %d of %d samples (attempt %d of %d), sending them on: %s", len(aborted),
                            len(todo), retries, e.max_retries + 1, abort_message(aborted[0][1]))
            todo, group = [i for i, _ in aborted], 1
        n = params.n
        return [[s.completion() for s in samples[j * n:(j + 1) * n]] for j in range(len(prompts))]

    def _attempt(self, rows: list[list[int]], sampling: list[dict], group: int,
                 loaded: set[int]) -> tuple[list[dict], bool]:
        """One round of requests on the engine's version; a newer version announced meanwhile is switched to (once a
        round: the switch aborts every request of it). Returns the answers and whether it switched."""
        e, switched, error = self.engine, False, None
        future = self._calls.submit(e.backend.generate, rows, sampling, group, e.version)
        while True:
            try:
                outs = future.result(timeout=POLL_S)
                break
            except Pending:
                pass
            wv = None if switched or error is not None else self.announcer.asked_after(e.version)
            if wv is None:
                continue
            try:
                self._switch(wv)
                loaded.add(wv.version)
            except Exception as err:  # raised once the round's requests are back (the pause aborted them)
                log.error("the weight update in flight to version %d failed: %s", wv.version, err)
                error = err
            switched = True
        if error is not None:
            raise error
        return outs, switched

    def _switch(self, wv: WeightVersion) -> None:
        e, t0, began = self.engine, time.perf_counter(), now()
        e.backend.update_weights(str(wv.path), wv.version, in_flight=True)
        e.version, e.path = wv.version, str(wv.path)  # (a server that comes back is brought to it)
        records = e.take_swaps(wv.version)
        for r in records:
            r["inflight_at"] = began  # the daemon traces it as a load during the generation (`double_buffer.outcomes`)
        e.switched.append((wv.version, records))
        how = ("pause with abort, update, continue, proof" if e.backend.cfg.inflight_switch == "pause" else
               "update with abort_all_requests, proof")
        log.info("switched in flight to weight version %d in %.3f s (%s): the aborted samples go on with it",
                 wv.version, time.perf_counter() - t0, how)

    def _answer(self, sample: Sample, out: dict, loaded: set[int], stops: list[int], stop_set: set[int]) -> None:
        """Add one answer to its sample: its tokens under the version SGLang labelled it with (a request aborted in
        SGLang's waiting queue comes back with no tokens and no label: 0.5.14 `_handle_abort_req`, "Abort before
        prefill")."""
        aborted = finish_type(out) == "abort"
        tokens, logprobs = partial_output(out) if aborted else (None, None)
        if aborted and not len(tokens):
            sample.finish = sample.ended(stop_set)
            return
        label = weight_label(out)
        if not label.lstrip("-").isdigit() or int(label) not in loaded:
            raise VersionMismatch(f"SGLang output {out.get('meta_info', {}).get('id')!r} was generated with weight "
                                  f"version {label!r}, not one of {sorted(loaded)} the engine loaded during the call: "
                                  "is another client updating this server's weights?")
        if sample.meta is None:
            sample.meta = answer_meta(out)  # the first answer with tokens: the prompt's prefill
        if aborted:
            sample.add(tokens, logprobs, int(label))
            sample.finish = sample.ended(stop_set)
        else:
            c = parse_output(out, None, stops)
            sample.add(c.tokens, c.logprobs, int(label))
            sample.finish = c.finish_reason

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
