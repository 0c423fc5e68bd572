"""The SGLang servers one rollout daemon drives over HTTP: health, load balancing, weight swaps.

`ServerPool` speaks plain JSON over `http.client` (standard library; one connection per call, a
thread per server) to the servers in `rollout.sglang.urls`. Invariants:
- every server carries the weight version it last loaded through us (-1: as launched; None:
  unknown, after a failed or missed update); `generate` sends work only to healthy servers on the
  version asked for, whole prompt groups to the least-loaded one, so a group shares a prefix cache;
- a server that fails a call (connection error, timeout, 5xx) is marked down and its rows go to
  the others within the same call; a 4xx is the request's fault and raises `RequestRefused`;
- a weight swap on a server is always pause -> update_weights_from_disk -> continue, and continue
  is sent even when the update fails, so no server is left paused by us;
- a server marked down is probed with /health_generate again after `health_check_interval_s`,
  at the next weight swap; it serves again only once it has loaded the engine's version.
The servers must read the weight store's path: run them on the daemon's node.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from offpolicy.config import SGLangConfig
from offpolicy.engines.sglang.wire import (
    RequestRefused,
    ServerUnavailable,
    SGLangError,
    WeightUpdateError,
    error_message,
    generate_body,
)
from offpolicy.weights.formats import NATIVE, checkpoint_format

log = logging.getLogger("offpolicy.sglang")

HEALTH_TIMEOUT_S = 30.0  # /health_generate itself waits up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s by default)


class ServerDown(Exception):
    """A server did not answer a call properly (connection, timeout, 5xx); it is marked down."""


@dataclass
class Server:
    url: str
    healthy: bool = False
    version: int | None = -1  # weight version loaded through us; -1 = as launched; None = unknown
    checked_at: float = float("-inf")  # monotonic time of the last health probe
    inflight: int = 0  # rows sent and not yet answered


class ServerPool:
    def __init__(self, cfg: SGLangConfig, need_deterministic: bool = False, weights_format: str = NATIVE):
        self.cfg = cfg
        self.need_deterministic = need_deterministic
        self.weights_format = weights_format  # rollout.weights_format: what every server must have been launched with
        self.servers = [Server(u.rstrip("/")) for u in cfg.urls]
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.servers)), thread_name_prefix="sglang-http")

    # --- plain calls ---------------------------------------------------------------------------------

    def call(self, server: Server, method: str, path: str, body: Any = None, timeout: float = 60.0) -> Any:
        """One JSON call; returns the decoded body (or text). Raises ServerDown or RequestRefused."""
        parts = urlsplit(server.url)
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut short
            raise ServerDown(f"{server.url}{path}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if resp.status >= 500:
            raise ServerDown(f"{server.url}{path}: HTTP {resp.status}: {error_message(raw)}")
        if resp.status >= 400:
            raise RequestRefused(server.url, path, resp.status, error_message(raw))
        if "json" not in (resp.getheader("Content-Type") or ""):
            return raw.decode(errors="replace")
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise ServerDown(f"{server.url}{path}: answered HTTP {resp.status} with a body that is not JSON") from None

    def call_object(self, server: Server, method: str, path: str, body: Any = None, timeout: float = 60.0) -> dict:
        """`call` for endpoints that answer a JSON object."""
        answer = self.call(server, method, path, body, timeout)
        if not isinstance(answer, dict):
            raise ServerDown(f"{server.url}{path}: answered {str(answer)[:200]!r}, not a JSON object")
        return answer

    def probe(self, server: Server, quiet: bool = False) -> bool:
        """GET /health_generate: 200 means the server generates; anything else marks it down."""
        server.checked_at = time.monotonic()
        try:
            self.call(server, "GET", "/health_generate", timeout=HEALTH_TIMEOUT_S)
        except (ServerDown, RequestRefused) as e:
            server.healthy = False
            if not quiet:
                log.warning("SGLang server %s is not healthy: %s", server.url, e)
            return False
        server.healthy = True
        return True

    # --- start --------------------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Wait up to startup_timeout_s for /health_generate of every server; then check each one's
        /model_info (a generation model) and, if seeds are used, /server_info (deterministic mode)."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = list(self.servers)
        while waiting and time.monotonic() < deadline:
            waiting = [s for s in waiting if not self.probe(s, quiet=True)]
            if waiting:
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        for s in waiting:
            log.warning("SGLang server %s is not up yet; it is probed again at the next weight swap", s.url)
        for s in [s for s in self.servers if s.healthy]:
            try:
                self._check(s)
            except ServerDown as e:
                s.healthy = False
                log.warning("SGLang server %s failed its start-up checks, marked down: %s", s.url, e)
        if not any(s.healthy for s in self.servers):
            raise ServerUnavailable(f"no SGLang server of rollout.sglang.urls {self.cfg.urls} answered /health_generate "
                                    f"within rollout.sglang.startup_timeout_s={self.cfg.startup_timeout_s:.0f}: "
                                    "are they running on this node, on those ports?")

    def _check(self, s: Server) -> None:
        """A generation model, and deterministic sampling where seeds are used; raises SGLangError."""
        info = self.call_object(s, "GET", "/model_info", timeout=HEALTH_TIMEOUT_S)
        if not info.get("is_generation", False):
            raise SGLangError(f"{s.url}/model_info: the server runs {info.get('model_path')!r}, which is not a "
                              "generation model: launch it with the run's causal LM")
        if self.need_deterministic:
            server_info = self.call_object(s, "GET", "/server_info", timeout=HEALTH_TIMEOUT_S)
            if not server_info.get("enable_deterministic_inference", False):
                raise SGLangError(f"{s.url}/server_info: rollout.seed_per_prompt needs sampling_seed, which SGLang "
                                  "honours only in deterministic mode: launch the server with "
                                  "--enable-deterministic-inference or turn rollout.seed_per_prompt off")
        self._check_format(s, str(info.get("model_path")))
        log.info("SGLang server %s serves %s (weight_version %s)", s.url, info.get("model_path"),
                 info.get("weight_version"))

    def _check_format(self, s: Server, model_path: str) -> None:
        """The server's checkpoint (`/model_info` model_path: the launch checkpoint, or the version it last
        loaded, tokenizer_manager.py:2365-2390) must be in rollout.weights_format: SGLang keeps the
        quantization it was launched with, and an update loads tensors into the existing parameters
        (model_runner_components/weight_updater.py:174-258), so an fp8 version sent to a bf16 server
        would be cast without its scales, and the reverse fails."""
        fmt = checkpoint_format(model_path)
        if fmt is None:
            log.warning("SGLang server %s runs %s, whose config.json is not readable here: cannot check that it "
                        "was launched from a %s checkpoint (rollout.weights_format)", s.url, model_path,
                        self.weights_format)
        elif fmt != self.weights_format:
            raise SGLangError(f"{s.url}/model_info: the server runs {model_path}, a {fmt} checkpoint, but "
                              f"rollout.weights_format is {self.weights_format}: launch it from a "
                              f"{self.weights_format} checkpoint (e.g. the store's first version of that format, "
                              "docs/weights.md) or set rollout.weights_format to match")

    # --- generation ---------------------------------------------------------------------------------

    def generate(self, rows: list[list[int]], sampling: list[dict], group: int, version: int) -> list[dict]:
        """One SGLang output per row, in row order. Rows come in groups of `group` consecutive rows
        (a prompt's samples), each group sent whole to one server on `version`."""
        groups = [list(range(i, min(i + group, len(rows)))) for i in range(0, len(rows), group)]
        results: list[dict | None] = [None] * len(rows)
        while groups:
            usable = [s for s in self.servers if s.healthy and s.version == version]
            if not usable:
                raise ServerUnavailable(self._why_unusable(version))
            plan = self._assign(groups, usable)
            futures = [(s, idx, self._pool.submit(self._generate_on, s, idx, rows, sampling)) for s, idx in plan]
            groups = []
            for server, idx, future in futures:
                try:
                    outs = future.result()
                except ServerDown as e:
                    server.healthy = False
                    log.warning("SGLang server %s failed a /generate of %d rows, marked down; sending them to the "
                                "others: %s", server.url, len(idx), e)
                    groups += [idx[i:i + group] for i in range(0, len(idx), group)]
                    continue
                for i, out in zip(idx, outs):
                    results[i] = out
        return results  # type: ignore[return-value]  # every row was answered or the loop raised

    def _assign(self, groups: list[list[int]], usable: list[Server]) -> list[tuple[Server, list[int]]]:
        """Each group to the server with the fewest rows in flight (this call's included)."""
        load = {id(s): s.inflight for s in usable}
        plan: dict[int, list[int]] = {id(s): [] for s in usable}
        for g in groups:
            s = min(usable, key=lambda s: load[id(s)])
            plan[id(s)] += g
            load[id(s)] += len(g)
        return [(s, plan[id(s)]) for s in usable if plan[id(s)]]

    def _generate_on(self, server: Server, idx: list[int], rows: list[list[int]], sampling: list[dict]) -> list[dict]:
        stem = uuid.uuid4().hex[:12]
        body = generate_body([rows[i] for i in idx], [sampling[i] for i in idx], [f"offpolicy-{stem}-{i}" for i in idx])
        with self._lock:
            server.inflight += len(idx)
        try:
            outs = self.call(server, "POST", "/generate", body, timeout=self.cfg.request_timeout_s)
        finally:
            with self._lock:
                server.inflight -= len(idx)
        if not isinstance(outs, list) or len(outs) != len(idx) or not all(isinstance(o, dict) for o in outs):
            raise ServerDown(f"{server.url}/generate answered {type(outs).__name__} for a batch of {len(idx)} rows")
        return outs

    def _why_unusable(self, version: int) -> str:
        states = ", ".join(f"{s.url} ({'up' if s.healthy else 'down'}, version {s.version})" for s in self.servers)
        return (f"no SGLang server is up on weight version {version}: {states}; servers that were down come back "
                "at the next weight swap once /health_generate answers")

    # --- weight swaps -------------------------------------------------------------------------------

    def update_weights(self, path: str, version: int) -> None:
        """Swap every reachable server to the version at `path` (pause, update, continue). A refusal
        raises WeightUpdateError; unreachable servers are marked down and skipped."""
        now = time.monotonic()
        for s in self.servers:
            if not s.healthy and now - s.checked_at >= self.cfg.health_check_interval_s:
                self.probe(s)
        targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise ServerUnavailable(self._why_unusable(version))
        futures = [(s, self._pool.submit(self._update_on, s, path, version)) for s in targets]
        refused = []
        for s, future in futures:
            try:
                future.result()
            except ServerDown as e:
                s.healthy, s.version = False, None
                log.warning("SGLang server %s failed during the swap to version %d, marked down: %s", s.url, version, e)
            except (RequestRefused, WeightUpdateError) as e:
                s.version = None  # SGLang's rollback re-reads the new path: its weights are not known to be the old
                refused.append(f"{s.url}: {e}")
            else:
                s.version = version
        if refused:
            raise WeightUpdateError(f"SGLang refused weight version {version} from {path}; the engine keeps its old "
                                    "version number, and these servers take no work until a load succeeds on them: "
                                    + "; ".join(refused))
        if not any(s.version == version for s in self.servers):
            raise ServerUnavailable(self._why_unusable(version))

    def _update_on(self, server: Server, path: str, version: int) -> None:
        t, mode = self.cfg.update_timeout_s, self.cfg.pause_mode
        self.call(server, "POST", "/pause_generation", {"mode": mode}, timeout=t)
        try:
            # in_place keeps running requests and their KV cache, and SGLang refuses to flush the cache
            # while requests run (the whole update would then fail): flush afterwards, once idle
            body: dict[str, Any] = {"model_path": path, "weight_version": str(version), "flush_cache": mode != "in_place"}
            if self.cfg.load_format is not None:
                body["load_format"] = self.cfg.load_format
            answer = self.call_object(server, "POST", "/update_weights_from_disk", body, timeout=t)
            if not answer.get("success"):
                raise WeightUpdateError(f"update_weights_from_disk answered {answer!r}")
        finally:
            self.call(server, "POST", "/continue_generation", {}, timeout=t)
        if mode == "in_place":
            f = self.cfg.flush_timeout_s
            self.call(server, "POST", f"/flush_cache?timeout={f}", timeout=t + f)
        info = self.call_object(server, "GET", "/model_info", timeout=t)
        if str(info.get("weight_version")) != str(version):
            raise WeightUpdateError(f"after the update /model_info says weight_version {info.get('weight_version')!r}, "
                                    f"not {version}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
