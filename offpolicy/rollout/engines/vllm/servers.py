"""The vLLM servers one rollout daemon drives over HTTP (`offpolicy.rollout.engines.http_pool.ServerPool`).

What is vLLM's here (vLLM 0.32 or 0.26, servers started with VLLM_SERVER_DEV_MODE=1 and offpolicy's
worker extension, `launch.py`): health `/health`; each server's vLLM version (`GET /version`), which says
what it speaks (`versions.Api`); generation through the tokens API `POST /inference/v1/generate` (token ids
in and out, no tokenizer), one request per prompt, sent concurrently so the server batches them; and the
swap, `/pause?mode=wait&clear_cache=false` -> `/collective_rpc offpolicy_load` -> proof -> label
(`/update_weight_version`, or the worker extension's where vLLM keeps none) -> `/resume`, with resume sent
even when a step fails, so no server is left paused by us; a weight update in flight (`switch_on`,
rollout.inflight_updates, `inflight.py`) pauses with mode=keep and asks each request's sampled tokens first. Invariants:
- every generate request carries its server's weight version as its prefix-cache salt (`versions.version_salt`):
  no request reuses KV blocks computed by another version, so a swap resets no cache;
- a server serves only after its baseline: the fingerprint offset measured on its own start-up load
  (`check`, again after it was down: a restarted server is a new engine); a server whose weight
  label is a number ran versions before we knew it (or failed a load: label -1), so its next load
  is a rebuild, vLLM's own start-up path, which defines its offset;
- a version is set on a server only once the load is proven (rollout.vllm.verify), else the server
  takes no work until a load succeeds; with load_method auto a failed in-place load is retried as a
  rebuild, and that server rebuilds from then on.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from offpolicy.config import VLLMConfig
from offpolicy.rollout.engines.errors import EngineError, RequestRefused, WeightUpdateError
from offpolicy.rollout.engines.http_pool import HEALTH_TIMEOUT_S, Server, ServerDown, ServerPool
from offpolicy.rollout.engines.vllm.versions import Api, api, generate_request
from offpolicy.rollout.engines.vllm.progress import counts
from offpolicy.rollout.engines.vllm.wire import load_methods, load_until_proven, offset_of

log = logging.getLogger("offpolicy.vllm")

GENERATE = "/inference/v1/generate"
MAX_CONCURRENT = 256  # requests in flight per server and generate call


class VLLMServers(ServerPool):
    name = "vLLM"
    health_path = "/health"
    section = "rollout.vllm"
    quiet_probes = True  # the engine logs its own wait for a restarted server

    def __init__(self, cfg: VLLMConfig):
        super().__init__(cfg)
        self._requests = ThreadPoolExecutor(max_workers=MAX_CONCURRENT, thread_name_prefix="vllm-request")
        self.swaps: list[dict] = []  # a record per server and swap (seconds, method, proof): metrics and logs
        self.maps = 0  # versions whose shard files the workers keep registered for their reads (staging.map_versions)

    # --- start and restarts ---------------------------------------------------------------------------

    def check(self, s: Server) -> None:
        """The server must have the dev endpoints and our worker extension; measures its fingerprint offset."""
        s.state["api"] = api(str(self.call_object(s, "GET", "/version", timeout=HEALTH_TIMEOUT_S).get("version")))
        try:
            label = self.label(s)
        except RequestRefused as e:
            raise EngineError(f"vLLM {s.state['api'].version} at {s.url} has no weight endpoints ({e}): start the "
                              "vLLM server with VLLM_SERVER_DEV_MODE=1 and offpolicy's flags (offpolicy.rollout."
                              "engines.vllm.launch.server_command, docs/vllm.md)") from None
        models = self.call_object(s, "GET", "/v1/models", timeout=HEALTH_TIMEOUT_S)
        root = next((m.get("root") for m in models.get("data", [])), None)
        if str(label).lstrip("-").isdigit() and s.state.get("offset") is None:
            s.state["rebuild_baseline"] = True  # it ran a version before we knew it: its next load rebuilds
        elif self.cfg.verify:
            s.state["reports"] = self.rpc(s, "offpolicy_baseline", {}, HEALTH_TIMEOUT_S * 10)
            s.state["offset"] = offset_of(s.state["reports"])
            s.state["rebuild_baseline"] = False
        s.version = int(label) if str(label).lstrip("-").isdigit() else -1
        log.info("vLLM server %s (vLLM %s) serves %s (weight version %s)", s.url, s.state["api"].version, root, label)

    def revived(self, s: Server) -> None:
        """A server that answers again is checked anew (a restart is a new engine)."""
        try:
            s.state["offset"] = None
            s.state.pop("reports", None)  # the last proven load was the old engine's
            self.check(s)
        except (ServerDown, EngineError) as e:
            s.healthy = False
            log.warning("vLLM server %s answered again but failed its checks: %s", s.url, e)
        else:
            log.info("vLLM server %s is back (weight version %s)", s.url, s.version)

    @property
    def output_versions(self) -> bool:
        """Whether every server stamps its outputs with its weight label (vLLM 0.32, not 0.26)."""
        return all(s.state["api"].engine_labels for s in self.servers if isinstance(s.state.get("api"), Api))

    def label(self, s: Server) -> str | None:
        """The server's weight label: vLLM's own (0.32), or the worker extension's (0.26)."""
        if s.state["api"].engine_labels:
            return self.call_object(s, "GET", "/weight_info", timeout=HEALTH_TIMEOUT_S).get("weight_version")
        labels = {r.get("label") for r in self.rpc(s, "offpolicy_label", {}, HEALTH_TIMEOUT_S)}
        return labels.pop() if len(labels) == 1 else "-1"  # workers that disagree ran something we did not prove

    def set_label(self, s: Server, label: str, timeout: float) -> None:
        if s.state["api"].engine_labels:
            self.call(s, "POST", "/update_weight_version", {"new_version": label}, timeout=timeout)
        else:
            self.rpc(s, "offpolicy_set_label", {"label": label}, timeout)

    def rpc(self, s: Server, method: str, kwargs: dict[str, str], timeout: float) -> list[dict]:
        """A worker-extension method on every worker of the server; its JSON answers."""
        answer = self.call_object(s, "POST", "/collective_rpc", {"method": method, "kwargs": kwargs,
                                                                  "timeout": timeout}, timeout=timeout + 30)
        results = answer.get("results")
        if not isinstance(results, list) or not results:
            raise EngineError(f"{s.url}/collective_rpc {method} answered {str(answer)[:200]}: was the server started "
                              "with --worker-extension-cls offpolicy.rollout.engines.vllm.worker.Extension?")
        return [json.loads(r) for r in results]

    # --- generation ---------------------------------------------------------------------------------

    def generate_on(self, server: Server, rows: list[list[int]], sampling: list[dict]) -> list[dict]:
        stem, a = uuid.uuid4().hex[:12], server.state["api"]
        futures = [self._requests.submit(self.call_object, server, "POST", GENERATE,
                                         generate_request(a, row, sp, f"offpolicy-{stem}-{i}", server.version),
                                         self.cfg.request_timeout_s, True)
                   for i, (row, sp) in enumerate(zip(rows, sampling))]
        return [f.result() for f in futures]

    # --- weight swaps -------------------------------------------------------------------------------

    def update_on(self, server: Server, path: str, version: int, in_flight: bool = False) -> None:
        """Pause (mode wait: no request in flight; mode keep `in_flight`: its requests stay, frozen between two steps,
        and the record's `progress` says how many tokens each had sampled, `progress.py`), load, label, resume."""
        t, t0, calls, progress = self.cfg.update_timeout_s, time.perf_counter(), {}, None

        def timed(name: str, step, *args):
            t1 = time.perf_counter()
            try:
                return step(*args)
            finally:
                calls[name] = time.perf_counter() - t1

        # No prefix-cache reset: each request is salted with its server's version (`versions.version_salt`), so no
        # request reuses KV blocks of another version; vLLM's reset walks every block in Python (slow on a large
        # cache: docs/vllm.md, "Every version is proven, not assumed"), and its pause would run one (clear_cache)
        timed("pause", self.call, server, "POST", f"/pause?mode={'keep' if in_flight else 'wait'}&clear_cache=false",
              None, t)
        try:
            if in_flight:  # every TP rank holds the same requests: rank 0's counts
                progress = counts(timed("progress", self.rpc, server, "offpolicy_progress", {}, t)[0])
            record = self.load(server, path, version)
            timed("label", self.set_label, server, str(version), t)
        finally:
            timed("resume", self.call, server, "POST", "/resume", None, t)
        record["seconds"] = time.perf_counter() - t0
        record["calls"] = record["seconds"] - record.get("rpc", 0.0)  # pause, label, resume (HTTP)
        record["call_seconds"] = calls
        if progress is not None:
            record["progress"] = progress
        self.swaps.append(record)

    def switch_on(self, server: Server, path: str, version: int) -> None:
        self.update_on(server, path, version, in_flight=True)

    def load(self, s: Server, path: str, version: int) -> dict:
        """Load `path` on one server and prove it (rollout.vllm.load_method, verify); raises WeightUpdateError."""
        t = self.cfg.update_timeout_s
        methods = load_methods(self.cfg.load_method, s.state.get("rebuild_baseline") or s.state.get("rebuild"))

        rpc = [0.0]  # the load RPCs' wall seconds (the workers' load, wait and hashes, and the call itself)

        def load(method: str) -> list[dict]:
            t0 = time.perf_counter()
            reports = self.rpc(s, "offpolicy_load", {"path": path, "method": method, "stage": self.cfg.prefetch,
                                                     "maps": self.maps, "threads": self.cfg.stage_threads}, t)
            rpc[0] += time.perf_counter() - t0
            if s.state.pop("rebuild_baseline", False):  # vLLM's own fresh-load path: it defines the offset
                s.state["offset"] = offset_of(reports)
            return reports

        record = load_until_proven(load, methods, lambda: s.state["offset"], self.cfg.verify, s.url, version, s.state)
        if record is None:
            # its tensors are now neither version: label it so that no later check takes its state as a baseline
            self.set_label(s, "-1", t)
            raise WeightUpdateError(f"{s.url}: after loading version {version} ({' then '.join(methods)}) the server's "
                                    "tensors are not the version's (fingerprint check): it generates no more until a "
                                    "load succeeds; see docs/vllm.md")
        if record["method"] == "rebuild" and methods[0] == "inplace":
            s.state["rebuild"] = True  # its in-place loads do not hold: rebuild from now on
        return {"url": s.url, **record, "rpc": rpc[0]}

    def close(self) -> None:
        super().close()
        self._requests.shutdown(wait=False, cancel_futures=True)

