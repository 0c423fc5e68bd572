"""`VLLMEngine`: the RolloutEngine protocol on vLLM, in process or over HTTP.

`rollout.vllm.mode` picks the backend: `LocalBackend` (vllm.LLM in this process) or `VLLMServers`
(running vLLM servers). Both take one row per prompt (with its `n`) and answer the tokens API's
JSON shape; this class builds the rows, parses the answers and retries aborts. Invariants:
- `generate` returns exactly `params.n` completions per prompt, in prompt order, each with the
  tokens and behaviour logprobs vLLM sampled and finish reason "stop" or "length": "stop" exactly when it ends on
  a stop token, those every engine stops on (`model_stop_ids`, all sent as `stop_token_ids`, never `ignore_eos`;
  vLLM adds its own generation config's EOS ids, 0.32 `sampling_params.py:786-797`, a subset where it starts
  from `model.path`) and params.stop_token_ids; vLLM checks them before the length limit
  (`v1/core/sched/utils.py:98-119`);
- every completion was generated with the weight version the engine reports (`version`), and every
  version was proven loaded (rollout.vllm.verify) before it was reported; where the servers stamp outputs
  with their weight label (vLLM 0.32, `versions.py`) each sample's label is checked too; with
  rollout.inflight_updates (HTTP) a generate call may move its requests to newer staged versions
  (`inflight.py`), and each completion's `version_runs` then say which version produced each token (never a
  newer one than did);
- aborted samples are generated again (their whole prompt), at most rollout.vllm.max_retries times;
- with every server down (killed while generating or swapping), `generate` and `load` wait up to
  rollout.vllm.recover_timeout_s for one to come back, bring it to the engine's version (the daemon
  keeps that version readable) and go on; `interrupt` (the daemon stops) ends that wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec

from offpolicy.config import Config
from offpolicy.data.tokenizer import load_tokenizer
from offpolicy.rollout.engines import Completion, SamplingParams, model_stop_ids, request_stops, sample_seed
from offpolicy.rollout.engines.errors import RetriesExhausted, ServerUnavailable
from offpolicy.rollout.engines.placement import shared_with_learner
from offpolicy.rollout.engines.staging import map_versions, staged_said
from offpolicy.rollout.engines.vllm.inflight import Switcher
from offpolicy.rollout.engines.vllm.wire import files_said, parse_choice, request_counts, sampling_params, waited_said
from offpolicy.weights import WeightVersion

log = logging.getLogger("offpolicy.vllm")


def _on_cpu(cfg: Config) -> bool:
    import torch

    return cfg.rollout.device == "cpu" or not torch.cuda.is_available()


def prefetch_setting(cfg: Config) -> str:
    """rollout.vllm.prefetch as the servers' workers get it: "auto" becomes "direct" where the run puts the rollout on
    a learner GPU (`placement`), since the workers' "auto" stages a version on their GPU where its free memory allows
    (`where.resolve`), and beside a learner that memory is the learner's to grow into; "direct" keeps none, and its
    loads beside a training learner beat "hash"'s (measured: docs/vllm.md, "Staged loads")."""
    setting, shared = cfg.rollout.vllm.prefetch, shared_with_learner(cfg)
    if setting != "auto" or not shared or cfg.rollout.device == "cpu":  # CPU servers: the workers' auto (hash)
        return setting
    log.info("rollout.vllm.prefetch=auto: nothing is staged ahead (direct: each load reads the version onto the GPU a "
             "window at a time) since the rollout shares GPU %s with the learner (run.rollout_gpus, run.learner_gpus); "
             "rollout.vllm.prefetch=host stages in page-locked host memory (the fastest load beside a learner), "
             "device on the GPU", ", ".join(shared))
    return "direct"


class VLLMEngine:
    def __init__(self, cfg: Config, seed: int = 0):
        cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(
            cfg.rollout, vllm=msgspec.structs.replace(cfg.rollout.vllm, prefetch=prefetch_setting(cfg))))
        v = cfg.rollout.vllm
        self.cfg, self.v = cfg, v
        self.stop_ids = model_stop_ids(cfg.model, load_tokenizer(cfg.model.tokenizer).eos_token_id)
        self.version = -1
        self.path: str | None = None  # the loaded version's directory (recovery loads it on a restarted server)
        self.aborted = 0
        self.last_loads: list[dict] = []  # the records of the last `load` (see there)
        self.switched: list[tuple[int, list[dict]]] = []  # each switch in flight's version and records, until
        # the prefetcher's `drain` reports them (a generate call may switch more than once)
        self.stopping = threading.Event()  # set by `interrupt`: no more waiting for a server
        self.prefetcher = None  # rollout.double_buffer over HTTP: the servers hash each version's files ahead
        self.inflight = False  # rollout.inflight_updates over HTTP: switch to staged versions during generate calls
        self.inflight_compared = self.inflight_disagreements = 0  # samples whose switch counts were checked against
        # vLLM's labels (0.32), and of those the ones split differently (`inflight.Switcher.runs`)
        if v.mode == "http":
            from offpolicy.rollout.engines.vllm.servers import VLLMServers

            self.backend = VLLMServers(v)
            self.backend.maps = map_versions(cfg.weights)  # the workers' reads onto their GPUs: registered maps
            self.backend.wait_ready()
            inflight = cfg.rollout.inflight_updates is True  # auto is off for vLLM (docs/vllm.md, "Updates in flight")
            if (cfg.rollout.double_buffer is True or (cfg.rollout.double_buffer == "auto" and (inflight
                                                                                            or not _on_cpu(cfg)))):
                from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher

                self.prefetcher = VLLMPrefetcher(self)
                self.inflight = inflight
        else:
            on_cpu = _on_cpu(cfg)
            if on_cpu and cfg.rollout.weights_format != "native":
                raise ValueError(f"rollout.weights_format is {cfg.rollout.weights_format}, but vLLM on a CPU runs "
                                 "native weights only (docs/vllm.md): use rollout.weights_format=native, or a GPU")
            from offpolicy.rollout.engines.vllm.local import LocalBackend

            self.backend = LocalBackend(cfg, seed, on_cpu)

    def load(self, weights: WeightVersion) -> float:
        """Swap every server (or the engine) to `weights`; `last_loads` then holds a record per server of this
        load (and of any restarted server brought back since the last): method, proof, seconds."""
        t0 = time.perf_counter()
        self._until_a_server(lambda: self.backend.update_weights(str(weights.path), weights.version))
        self.version, self.path = weights.version, str(weights.path)
        self.take_swaps(weights.version)
        return time.perf_counter() - t0

    def take_swaps(self, version: int) -> list[dict]:
        """The servers' records of the swap to `version` (and of any restarted server brought back since the last),
        taken out (a long run keeps no record per version) into `last_loads`, each logged."""
        taken = self.backend.swaps[:]
        del self.backend.swaps[:len(taken)]
        self.last_loads = taken
        for r in taken:
            log.info("weight version %d on %s: %s load%s in %.3f s (vLLM's load %.3f s%s, fingerprints %.3f s: the "
                     "model's %.3f s, the files' %s%s)", version, r.get("url", "the engine"), r["method"],
                     ", proven by fingerprint" if r["verified"] else " (not checked)", r["seconds"],
                     r.get("load", 0.0), staged_said(r), r.get("hash", 0.0), r.get("hash_model", 0.0),
                     files_said(r), waited_said(r))
            if "staging_error" in r:
                log.warning("weight version %d on %s: vLLM read the files itself, the staging failed: %s",
                            version, r.get("url", "the engine"), r["staging_error"])
        return taken

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        if not self.inflight:
            return self._generate_all(prompts, params, seeds, None)
        with Switcher(self) as switcher:  # rollout.inflight_updates: newer staged versions switched to meanwhile
            done = self._generate_all(prompts, params, seeds, switcher)
        if switcher.error is not None:  # tokens after its pause came from weights that are neither version
            raise switcher.error
        for group in done:
            for c in group:
                out, choice, first, where = c.meta.pop("inflight")
                c.version_runs = switcher.runs(out, choice, first, len(c.tokens), where)
        self.inflight_compared += switcher.compared
        self.inflight_disagreements += switcher.disagreements
        return done

    def _generate_all(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None,
                      switcher: Switcher | None) -> list[list[Completion]]:
        stops = request_stops(self.stop_ids, params, prompts, seeds)
        sampling = [sampling_params(params, stops, None if seeds is None else sample_seed(seeds[j], 0))
                    for j in range(len(prompts))]
        # the servers' outputs carry their weight label (vLLM 0.32; not 0.26, nor vllm.LLM in process); with updates
        # in flight the labels are the tokens' runs, checked against the versions loaded (`inflight.span_runs`)
        expected = (str(self.version) if self.version >= 0 and self.backend.output_versions and switcher is None
                    else None)
        done: list[list[Completion] | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for attempt in range(self.v.max_retries + 1):
            first = self.version  # the version this attempt's requests begin on
            outs = self._generate([list(prompts[j]) for j in todo], [sampling[j] for j in todo])
            aborted = []
            for j, out in zip(todo, outs):
                choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
                if len(choices) != params.n:
                    raise ServerUnavailable(f"vLLM answered {len(choices)} samples for a prompt, not {params.n}")
                where = [f"{out.get('request_id', '?')}[{i}]" for i in range(len(choices))]
                parsed = [parse_choice(c, expected, w) for c, w in zip(choices, where)]
                if any(c is None for c in parsed):
                    aborted.append(j)
                    continue
                parsed[0].meta.update(request_counts(out, params.n))  # the n samples shared one prefill
                if switcher is not None:  # its runs once the call's switches are all known
                    for c, choice, w in zip(parsed, choices, where):
                        c.meta["inflight"] = (out, choice, first, w)
                done[j] = parsed  # type: ignore[assignment]
            if not aborted:
                break
            self.aborted += len(aborted) * params.n
            log.warning("vLLM aborted samples of %d of %d prompts (attempt %d of %d), generating them again",
                        len(aborted), len(todo), attempt + 1, self.v.max_retries + 1)
            todo = aborted
        else:
            raise RetriesExhausted(f"vLLM aborted samples of {len(todo)} prompts {self.v.max_retries + 1} times; raise "
                                   "rollout.vllm.max_retries or look at the servers' logs")
        return done  # type: ignore[return-value]

    def _generate(self, rows: list[list[int]], sampling: list[dict]) -> list[dict]:
        return self._until_a_server(lambda: self.backend.generate(rows, sampling, 1, self.version))

    def _until_a_server(self, call):
        """`call()`; over HTTP with every server down, wait up to rollout.vllm.recover_timeout_s for one to come back
        (`ServerPool.until_a_server`)."""
        if self.v.mode != "http":
            return call()
        return self.backend.until_a_server(call, self.stopping, lambda: (self.version, self.path))

    def interrupt(self) -> None:
        """The daemon stops: a wait for a server to come back ends now (it raises Stopped), and so do the
        generate calls to servers in flight (`ServerPool.cut`: the servers abort them)."""
        self.stopping.set()
        if self.v.mode == "http":
            self.backend.cut()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Never called: over HTTP a server that goes down is waited for (`_recover`); in engine mode vLLM 0.26 reports
        a failed engine core itself (the call in flight raises EngineDeadError, `v1/engine/core_client.py:454-457,
        849-856`; its monitor thread marks a killed one dead, 696-708, and later calls raise it, 667-672), which ends
        the daemon as any failed generate does."""

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.backend.close()
