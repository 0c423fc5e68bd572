"""The SGLang servers one rollout daemon drives over HTTP (`offpolicy.rollout.engines.http_pool.ServerPool`).

What is SGLang's here: the health path `/health_generate`, the start-up checks (`/model_info`,
`/server_info`), the batched `/generate` body, and the swap: always pause -> update_weights_from_disk
-> continue, with continue sent even when the update fails, so no server is left paused by us; then the
version's proof (`rollout.sglang.proof`, `proof.by_mode`): `/get_weights_by_name` of a few tensors against the
version's files (`proof.py`) where the model has it, else the fingerprint of every tensor (`fingerprint_proof.py`),
which `POST /update_weights_from_tensor` runs in the server's workers through offpolicy's loader (the server must be
launched with `--custom-weight-loader` naming it, `worker.LOADER`; `/server_info` says whether it was), against an
offset measured on what the server holds before its first update through us. A server whose tensors differ takes no
work until a load succeeds on it (the pool's refusal), each proven or unproven load leaves a record in `swaps`.
Health, load balancing, marking down and version gating are the shared pool's.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from offpolicy.config import SGLangConfig
from offpolicy.rollout.engines.errors import RequestRefused
from offpolicy.rollout.engines.http_pool import HEALTH_TIMEOUT_S, Server, ServerDown, ServerPool
from offpolicy.rollout.engines.sglang.fingerprint_proof import FingerprintProof, serialized, why_unavailable
from offpolicy.rollout.engines.sglang.proof import Expected, by_mode, expect, prove
from offpolicy.rollout.engines.sglang.worker import LOADER
from offpolicy.rollout.engines.sglang.wire import SGLangError, WeightUpdateError, generate_body
from offpolicy.weights.formats import NATIVE, checkpoint_format

log = logging.getLogger("offpolicy.sglang")

__all__ = ["HEALTH_TIMEOUT_S", "Server", "ServerDown", "SGLangServers"]

ABORT_ALL = "abort_all"  # `update_only`'s mode of a switch with rollout.sglang.inflight_switch abort_all: no pause


class SGLangServers(ServerPool):
    name = "SGLang"
    health_path = "/health_generate"
    section = "rollout.sglang"

    def __init__(self, cfg: SGLangConfig, need_deterministic: bool = False, weights_format: str = NATIVE):
        super().__init__(cfg)
        self.need_deterministic = need_deterministic
        self.weights_format = weights_format  # rollout.weights_format: what every server must have been launched with
        self.swaps: list[dict] = []  # a record per server and load (method, proof, seconds): the engine takes them
        self.expected: Expected | None = None  # what the servers must read back after the load under way

    def check(self, s: Server) -> None:
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

    def generate_on(self, server: Server, rows: list[list[int]], sampling: list[dict]) -> list[dict]:
        stem = uuid.uuid4().hex[:12]
        body = generate_body(rows, sampling, [f"offpolicy-{stem}-{i}" for i in range(len(rows))])
        return self.call(server, "POST", "/generate", body, timeout=self.cfg.request_timeout_s, cuttable=True)

    def revived(self, s: Server) -> None:
        """A server back up is a new process: what its last load proved no longer holds."""
        for key in ("proof", "server_info", "fingerprint"):
            s.state.pop(key, None)

    def update_weights(self, path: str, version: int, servers: list[Server] | None = None,
                       in_flight: bool = False) -> None:
        """The pool's swap of every reachable server (or `servers`), each proven after its update (`update_on`, or
        `switch_on` during a generate call)."""
        self.expected = expect(path, version)
        super().update_weights(path, version, servers, in_flight)

    def update_on(self, server: Server, path: str, version: int, pause: str | None = None) -> None:
        """pause (rollout.sglang.pause_mode, or `pause`) -> update -> continue -> the proof; a record in `swaps`."""
        t0 = time.perf_counter()
        fingerprint = self.fingerprint(server)  # its baseline before the server's first update through us
        self.update_only(server, path, version, pause or self.cfg.pause_mode)
        expected = self.expected
        if expected is None or (expected.version, expected.path) != (version, str(path)):
            expected = expect(path, version)
        where, state = f"SGLang server {server.url}", server.state.setdefault("proof", {})

        def read_back() -> dict:
            linear = not any(s.linear for s in expected.samples) or not self.server_info(server).get("quantization")
            return prove(expected, lambda name, rows: self.read_back(server, name, rows), state, where, linear=linear)

        record = by_mode(self.cfg.proof, read_back, state, lambda: fingerprint.prove(path, version, where))
        self.swaps.append({"url": server.url, "method": "disk", **record, "seconds": time.perf_counter() - t0})

    def switch_on(self, server: Server, path: str, version: int) -> None:
        """The update during a generate call (rollout.inflight_updates, `inflight.py`): SGLang ends every running
        request with the tokens it has sampled, all of the old version, before the update (rollout.sglang.
        inflight_switch: paused with mode abort, which returns once none runs; or the update's own
        abort_all_requests, whose lock waits for them); the engine sends each on as a continuation."""
        self.update_on(server, path, version, pause="abort" if self.cfg.inflight_switch == "pause" else ABORT_ALL)

    def server_info(self, server: Server) -> dict:
        """The server's `/server_info` (its ServerArgs, 0.5.14 `entrypoints/http_server.py:688-708`), once per start."""
        if "server_info" not in server.state:
            server.state["server_info"] = self.call_object(server, "GET", "/server_info",
                                                           timeout=self.cfg.update_timeout_s)
        return server.state["server_info"]

    def fingerprint(self, server: Server) -> FingerprintProof:
        """The server's fingerprint proof: made, and its baseline taken on the checkpoint it holds (`/model_info`
        model_path: its launch checkpoint, or the version it last loaded), before its first update through us."""
        if "fingerprint" not in server.state:
            if self.cfg.proof == "read_back":
                server.state["fingerprint"] = FingerprintProof(lambda name: (False, ""), 1, "rollout.sglang.proof is "
                                                                                           "read_back")
                return server.state["fingerprint"]
            info = self.server_info(server)
            why, attn_tp_size = why_unavailable(info, self.weights_format)
            tp = int(info.get("tp_size") or 1)
            proof = FingerprintProof(lambda name: self.send(server, name, tp), attn_tp_size, why)
            if why:
                log.warning("SGLang server %s cannot prove loads by fingerprint: %s", server.url, why)
            else:
                held = self.call_object(server, "GET", "/model_info", timeout=self.cfg.update_timeout_s)
                proof.baseline(str(held.get("model_path")))
            server.state["fingerprint"] = proof
        return server.state["fingerprint"]

    def send(self, server: Server, name: str, tp_size: int) -> tuple[bool, str]:
        """The fingerprint request (`fingerprint_proof`): `POST /update_weights_from_tensor` (0.5.14
        `entrypoints/http_server.py:1250-1269`, `UpdateWeightsFromTensorReqInput` `managers/io_struct.py:1522-1541`)
        of the one empty tensor `name` for each TP rank, through offpolicy's loader, on the target model's workers,
        with no cache flush (nothing is loaded)."""
        body = {"serialized_named_tensors": [serialized(name)] * tp_size, "load_format": LOADER, "flush_cache": False,
                "disable_draft_model": True}
        try:
            answer = self.call_object(server, "POST", "/update_weights_from_tensor", body,
                                      timeout=self.cfg.update_timeout_s)
        except RequestRefused as e:
            return False, str(e)
        return bool(answer.get("success")), str(answer.get("message"))

    def read_back(self, server: Server, name: str, rows: int):
        """`POST /get_weights_by_name` (0.5.14 `entrypoints/http_server.py:1340-1349`, `GetWeightsByNameReqInput`
        `managers/io_struct.py:1663-1665`): the parameter's first `rows` entries, or None where SGLang answers its
        400 "Get parameter by name failed" (a model class without a read-back, or a name it does not know)."""
        try:
            return self.call(server, "POST", "/get_weights_by_name", {"name": name, "truncate_size": rows},
                             timeout=self.cfg.update_timeout_s)
        except RequestRefused:
            return None

    def update_only(self, server: Server, path: str, version: int, mode: str) -> None:
        """pause (`mode`) -> update_weights_from_disk -> continue (-> flush) -> the weight_version read back; mode
        `ABORT_ALL`: no pause, the update aborts every running request itself (abort_all_requests) and holds new ones
        behind its lock until it is done (0.5.14 tokenizer_manager.py:1694-1725)."""
        t = self.cfg.update_timeout_s
        paused = mode != ABORT_ALL
        if paused:
            self.call(server, "POST", "/pause_generation", {"mode": mode}, timeout=t)
        try:
            # in_place keeps running requests and their KV cache, and SGLang refuses to flush the cache
            # while requests run (the whole update would then fail): flush afterwards, once idle
            body: dict[str, Any] = {"model_path": path, "weight_version": str(version), "flush_cache": mode != "in_place"}
            if not paused:
                body["abort_all_requests"] = True
            if self.cfg.load_format is not None:
                body["load_format"] = self.cfg.load_format
            answer = self.call_object(server, "POST", "/update_weights_from_disk", body, timeout=t)
            if not answer.get("success"):
                raise WeightUpdateError(f"update_weights_from_disk answered {answer!r}")
        finally:
            if paused:
                self.call(server, "POST", "/continue_generation", {}, timeout=t)
        if mode == "in_place":
            f = self.cfg.flush_timeout_s
            self.call(server, "POST", f"/flush_cache?timeout={f}", timeout=t + f)
        info = self.call_object(server, "GET", "/model_info", timeout=t)
        if str(info.get("weight_version")) != str(version):
            raise WeightUpdateError(f"after the update /model_info says weight_version {info.get('weight_version')!r}, "
                                    f"not {version}")

