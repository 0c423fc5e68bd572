"""`SGLangEngine`: the RolloutEngine protocol on SGLang, in process or over HTTP.

`rollout.sglang.mode` picks the backend: `LocalBackend` (sglang.Engine in this process) or
`ServerPool` (running SGLang servers). Both take one row per sample and answer SGLang's output
dicts; this class builds the rows, parses the answers and retries aborts. Invariants:
- `generate` returns exactly `params.n` completions per prompt, in prompt order, each with the
  tokens and behaviour logprobs SGLang sampled (log-softmax of logits / temperature, before top-k/
  top-p, which is what the learner scores) and finish reason "stop" or "length";
- every completion was generated with the weight version the engine reports (`version`), except with
  rollout.inflight_updates over HTTP, where a call may switch the servers to newer versions and each completion's
  `version_runs` say which version produced each token (`inflight.py`);
- aborted samples are generated again (with rollout.inflight_updates: sent on from the tokens they had), at most
  `rollout.sglang.max_retries` times, then `RetriesExhausted` is raised: an aborted sample is never returned;
- `load` swaps the engine, or every reachable server, to the new version or raises; `version`
  changes only on success, and a server that refused a version takes no work until a load succeeds;
- over HTTP with every server down, `load` and `generate` wait up to rollout.sglang.recover_timeout_s for one to come
  back (`offpolicy run` restarts the servers it launched), bring it to the engine's version and go on; a generate
  call then starts again from its prompts;
- every load is proven against the version's files (`rollout.sglang.proof`): by SGLang's own read-back (`proof.py`:
  `get_weights_by_name` of a few unfused tensors) where the model has one, else by the fingerprint of every tensor,
  computed in SGLang's workers (`fingerprint_proof.py`, `worker.py`); one whose tensors differ fails as a refused one
  does; `last_loads` holds a record per server (or the engine) of the last `load`: method, `verified`, `proof`, what
  was checked, seconds;
- a completion's finish reason is "stop" exactly when it ends on a stop token: the model's (`model_stop_ids`: the
  tokenizer's EOS and the EOS ids of `model.path`'s config.json / generation_config.json, which SGLang stops on by
  itself too, 0.5.14 `configs/model_config.py:1459-1477`, and all of which are sent) or one of
  params.stop_token_ids; wire.parse_output maps SGLang's "length" of a stop token sampled last (it checks the limit
  first) back to "stop".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from offpolicy.config import Config
from offpolicy.data.tokenizer import load_tokenizer
from offpolicy.rollout.engines import Completion, SamplingParams, model_stop_ids, request_stops
from offpolicy.rollout.engines.sglang.wire import (
    RetriesExhausted,
    abort_message,
    parse_output,
    samples_sampling,
)
from offpolicy.rollout.engines.staging import staged_said
from offpolicy.weights import WeightVersion

log = logging.getLogger("offpolicy.sglang")


class SGLangEngine:
    def __init__(self, cfg: Config, seed: int = 0):
        s = cfg.rollout.sglang
        self.stop_ids = model_stop_ids(cfg.model, load_tokenizer(cfg.model.tokenizer).eos_token_id)
        self.max_retries = s.max_retries
        self.version = -1
        self.path: str | None = None  # the loaded version's directory (a restarted server is brought back to it)
        self.stopping = threading.Event()  # set by `interrupt`: no more waiting for a server
        self.aborted = 0  # samples SGLang aborted and we generated again, since start
        self.last_loads: list[dict] = []  # the records of the last `load` (see there)
        self.switched: list[tuple[int, list[dict]]] = []  # each switch in flight's version and records, until the
        # announcer's `drain` reports them (rollout.inflight_updates over HTTP)
        self.prefetcher = None  # rollout.double_buffer in process; over HTTP the announcer of rollout.inflight_updates
        self.inflight = None  # rollout.inflight_updates over HTTP: calls switch to newer versions (inflight.py)
        self.http = s.mode == "http"
        if s.mode == "http":
            from offpolicy.rollout.engines.sglang.servers import SGLangServers

            self.backend = SGLangServers(s, need_deterministic=cfg.rollout.seed_per_prompt,
                                      weights_format=cfg.rollout.weights_format)
            self.backend.wait_ready()
            self.watch = None  # a server that goes down is waited for, and taken out of service
            if cfg.rollout.inflight_updates is True:  # auto stays off for SGLang servers (docs/sglang.md)
                from offpolicy.rollout.engines.sglang.inflight import Announcer, InFlight

                self.prefetcher = Announcer(self)
                self.inflight = InFlight(self, self.prefetcher)
        else:
            from offpolicy.rollout.engines.sglang.local import LocalBackend

            self.backend = LocalBackend(cfg, seed)
            self.watch = self.backend.watch  # SGLang's SIGQUIT (sigquit.py)
        ahead = (self.backend.staged or self.backend.files_ahead) if s.mode == "engine" else None  # or its files hashed
        if ahead is not None and cfg.rollout.double_buffer is not False:
            from offpolicy.rollout.engines.sglang.staged import StagedPrefetcher

            self.prefetcher = StagedPrefetcher(ahead, self, self.backend.stages_ahead)

    def load(self, weights: WeightVersion) -> float:
        """Swap every server (or the engine) to `weights`; `last_loads` then holds a record per server of this load
        (and of any load since the last whose swap failed on another server): method, proof, seconds."""
        t0 = time.perf_counter()
        self._until_a_server(lambda: self.backend.update_weights(str(weights.path), weights.version))
        self.version, self.path = weights.version, str(weights.path)
        self.take_swaps(weights.version)
        return time.perf_counter() - t0

    def _until_a_server(self, call):
        """`call()`; over HTTP with every server down (killed, restarted by `offpolicy run`), wait up to
        rollout.sglang.recover_timeout_s for one to come back, bring it to the engine's version and call again
        (`ServerPool.until_a_server`); a generate call then starts again from its prompts."""
        if not self.http:
            return call()
        return self.backend.until_a_server(call, self.stopping, lambda: (self.version, self.path))

    def take_swaps(self, version: int) -> list[dict]:
        """The backend's records of the swap to `version` (a load, or a switch in flight), taken out (a long run keeps
        no record per version) into `last_loads`, each logged."""
        taken = self.backend.swaps[:]
        del self.backend.swaps[:len(taken)]
        self.last_loads = taken
        for r in taken:
            log.info("weight version %d on %s: %s load in %.3f s%s, %s%s", version, r.get("url", "the engine"),
                     r["method"], r["seconds"], _parts(r), _proof(r), staged_said(r))
        return taken

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        return self._until_a_server(lambda: self._generate(prompts, params, seeds))

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  seeds: list[int] | None) -> list[list[Completion]]:
        if self.inflight is not None and self.version >= 0:
            return self.inflight.generate(prompts, params, seeds)
        stops = request_stops(self.stop_ids, params, prompts, seeds)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        sampling = samples_sampling(params, stops, len(prompts), seeds)
        expected = str(self.version) if self.version >= 0 else None
        done: list[Completion | None] = [None] * len(rows)
        todo, group = list(range(len(rows))), params.n
        for attempt in range(self.max_retries + 1):
            outs = self.backend.generate([rows[i] for i in todo], [sampling[i] for i in todo], group, self.version)
            aborted = []
            for i, out in zip(todo, outs):
                completion = parse_output(out, expected, stops)
                if completion is None:
                    aborted.append((i, abort_message(out)))
                else:
                    done[i] = completion
            if not aborted:
                break
            self.aborted += len(aborted)
            log.warning("SGLang aborted %d of %d samples (attempt %d of %d), generating them again: %s",
                        len(aborted), len(todo), attempt + 1, self.max_retries + 1, aborted[0][1])
            todo, group = [i for i, _ in aborted], 1
        else:
            raise RetriesExhausted(f"SGLang aborted {len(todo)} samples {self.max_retries + 1} times (last: "
                                   f"{aborted[0][1]}); raise rollout.sglang.max_retries or look at the servers' logs")
        n = params.n
        return [done[j * n:(j + 1) * n] for j in range(len(prompts))]  # type: ignore[misc]  # all filled

    def interrupt(self) -> None:
        """Over HTTP the generate calls in flight end now (`ServerPool.cut`: the servers abort them), and so does a wait
        for a server to come back (it raises Stopped); in process nothing of its own waits."""
        self.stopping.set()
        if self.http:
            self.backend.cut()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """In engine mode, once SGLang signals that a process of the engine failed (sigquit.py); never over HTTP."""
        if self.watch is not None:
            self.watch.listeners.append(callback)

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.close()
        self.backend.close()


def _parts(record: dict) -> str:
    """Where an in-process load's seconds went (SGLang's update call, the wait for its staging), for the log."""
    if "load" not in record:
        return ""
    waited = record.get("prefetch", {}).get("waited")
    return f" (SGLang's update {record['load']:.3f} s" + (
        f", waited {waited:.3f} s for the staging ahead)" if waited is not None else ")")


def _proof(record: dict) -> str:
    """How a load record was proven, for the log."""
    if not record["verified"]:
        return f"not proven: {record.get('why')}"
    if record.get("proof") == "fingerprint":
        return (f"proven by the fingerprint of every tensor ({len(record['groups'])} module groups) in "
                f"{record['proof_seconds']:.3f} s" + _files_said(record))
    return f"proven by read-back of {len(record['tensors'])} tensors in {record['proof_seconds']:.3f} s"


def _files_said(record: dict) -> str:
    """Who hashed the version's files for a fingerprint proof, where not its workers at the load."""
    if not record.get("files_ahead"):
        return ""
    if record.get("files_hash", {}).get("as_read"):
        return f" (the files hashed as the load read them, {record['files_hash']['seconds']:.3f} s)"
    return " (the files hashed ahead)"
