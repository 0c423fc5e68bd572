"""A stand-in SGLang server for tests: the endpoints and JSON shapes of sglang 0.5.23, on loopback.

It speaks exactly the shapes of tests/fixtures/sglang/*.json (each cites the SGLang source line it
was copied from) and refuses what SGLang refuses: unknown `sampling_params` keys (SGLang's JSON
contract), unknown `update_weights_from_disk` fields, a pause mode SGLang does not have. Tokens come
from a `sampler(rows, sampling_params) -> [(tokens, logprobs, "stop" | "length")]`: a toy one by
default, or a real model (tests/integration/test_sglang_daemons.py); a sample that stopped on its
`max_new_tokens`-th token is reported "length", as SGLang does. Knobs make it fail the ways a
real server fails: down, slow, 5xx, aborted rows, refused updates, another weight version, an update that reports
success and keeps the old tensors (`keep_weights`) or some of them (`stale`), a model class without a read-back
(`readback`), a launch without offpolicy's fingerprint loader (`custom_weight_loader`); launched from an MXFP4 GPT-OSS
checkpoint it goes down on its first update, as SGLang 0.5.14 does. Its parameters are the tensors of the checkpoint
it last loaded (or was launched from), which `/get_weights_by_name` reads back as SGLang 0.5.14's Llama does
(models/llama.py:702-773: float32 values of the whole parameter as nested lists, then the first `truncate_size`
entries of the first dimension), and which `/update_weights_from_tensor` hands to a registered custom loader in
SGLang's layout on each of `tp_size` ranks (tests/sglang_layout.py), as 0.5.14 does
(entrypoints/http_server.py:1250-1269, model_executor/model_runner.py:2066-2094); an unregistered load_format takes
the server down (SGLang's scheduler dies of the NotImplementedError).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from offpolicy.rollout.engines.sglang.worker import LOADER
from tests.sglang_layout import models_of, run_loader

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang"

# python/sglang/api/v1/api_types.py:180-207: the keys /generate accepts in sampling_params.
SAMPLING_KEYS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                 "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                 "custom_params", "beam_width", "watermark", "choice"}
# python/sglang/srt/managers/io_struct.py:1970-1992 (+ rid, http_worker_ipc of BaseReq).
UPDATE_KEYS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
               "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest", "rid", "http_worker_ipc"}
# 0.5.14 managers/io_struct.py:1522-1541 (+ rid, http_worker_ipc of BaseReq).
TENSOR_KEYS = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
               "disable_draft_model", "torch_empty_cache", "rid", "http_worker_ipc"}

class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # the client gave up waiting (the timeout tests) and closed the connection
        super().handle_error(request, client_address)


DOWN = 0  # an endpoint's status that drops the connection unanswered and takes the server down

Sampler = Callable[[list[list[int]], list[dict]], list[tuple[list[int], list[float], str]]]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def toy_sampler(rows: list[list[int]], sps: list[dict]) -> list[tuple[list[int], list[float], str]]:
    """max_new_tokens - 1 digits derived from the prompt and the seed, then the first stop token."""
    out = []
    for row, sp in zip(rows, sps):
        base = sum(row) + (sp.get("sampling_seed") or 0)
        n = sp["max_new_tokens"]
        stops = sp.get("stop_token_ids") or []
        tokens = [(base + k) % 10 for k in range(n - 1 if stops else n)] + stops[:1]
        out.append((tokens, [-0.125 * (k + 1) for k in range(len(tokens))], "stop" if stops else "length"))
    return out


def version_logprob(weight_version: str) -> float:
    """Token mode's logprob of a token made under `weight_version`: a mark of the version, for tests to check labels."""
    return -0.5 - 0.01 * int(weight_version) if str(weight_version).isdigit() else -0.25


def checkpoint_params(path: str) -> dict[str, tuple[str, list[int]]] | None:
    """(dtype, shape) of every tensor of an HF safetensors directory; None if `path` is not one."""
    from offpolicy.weights.safetensors_view import read_header

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    out = {}
    for f in files:
        header, _ = read_header(f)
        out.update({n: (i["dtype"], i["shape"]) for n, i in header.items() if n != "__metadata__"})
    return out or None


def read_back(path: str, name: str, truncate_size: int) -> list | None:
    """SGLang's get_weights_by_name of a model whose parameters are the tensors of the checkpoint at `path`: the
    parameter in float32 as nested lists, its first `truncate_size` entries of the first dimension (0.5.14
    models/llama.py:702-773; a tied lm_head answers the embedding, 711-720); None where SGLang answers None: no
    parameter of that name, or a model class without get_weights_by_name (GPT-OSS, model_runner.py:2129-2144)."""
    from offpolicy.weights.safetensors_view import map_tensors

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    try:
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    tensors = {n: t for f in files for n, t in map_tensors(f).items()}
    if name == "lm_head.weight" and name not in tensors:
        name = "model.embed_tokens.weight"
    if model_type == "gpt_oss" or name not in tensors:
        return None
    return tensors[name].float().tolist()[:truncate_size]


class FakeSGLang:
    def __init__(self, sampler: Sampler = toy_sampler, on_update: Callable[[str], None] | None = None,
                 deterministic: bool = False, model_path: str = "fake", host: str = "127.0.0.1", port: int = 0):
        self.sampler, self.on_update, self.deterministic = sampler, on_update, deterministic
        # the launch checkpoint; moved by every successful update (tokenizer_manager.py:2365-2390). A real
        # directory fixes the parameters (quantization, dtypes, shapes) as SGLang does at launch, and updates
        # are held to them (tests/fixtures/sglang/quantized_checkpoint.json)
        self.model_path = model_path
        self.params = checkpoint_params(model_path)
        self.cast_silently: list[str] = []  # tensors SGLang would have copied into a parameter of another dtype
        self.weight_version = "default"  # python/sglang/srt/arg_groups/fields/serving.py:172-175
        self.paused = False
        self.token_s = 0.0  # token mode: /generate makes a token a row every token_s seconds, and pauses abort it
        self.gate = threading.Condition()  # token mode: the pause, the abort and the requests running (`active`)
        self.aborting = False
        self.active = 0
        self.mark_versions = True  # token mode: each logprob the mark of its version; False: the sampler's
        self.hold_at: list[int] = []  # token mode: the next calls make this many tokens a row, then wait for an abort
        self.holding = threading.Event()  # ... set when a call waits there
        self.calls: list[tuple[str, str, object]] = []  # (method, path, body) of every call, in order
        self.lock = threading.Lock()
        # failure knobs
        self.healthy = True
        self.delay_s = 0.0  # /generate sleeps this long first
        self.generate_status = 0  # answer /generate with this HTTP status once (e.g. 503)
        self.abort_rows = 0  # abort this many of the next rows (finish_reason abort, no HTTP error)
        self.abort_unstarted = 0  # ... this many as if still waiting (no tokens, no weight_version)
        self.report_version: str | None = None  # claim this weight_version in outputs
        self.refuse_update = ""  # "" | "load" | "flush": refuse update_weights_from_disk like SGLang does
        self.busy = False  # requests run (pause_mode in_place): /flush_cache times out
        self.prefixes: set = set()  # (weight version, prompt) generated: the prefix cache's cached_tokens
        self.keep_weights = False  # an update succeeds (version and model_path move) but the parameters stay
        self.readback = True  # False: a model class without get_weights_by_name (GPT-OSS, Qwen in 0.5.14)
        self.custom_weight_loader = [LOADER]  # --custom-weight-loader (offpolicy's, as docs/sglang.md launches them)
        self.tp_size = 1  # --tp-size: the ranks the custom loader runs on
        self.dtype = None  # --dtype of the parameters (None: the checkpoint's)
        self.stale: tuple[str, ...] = ()  # checkpoint tensors an update leaves holding the previous version's values
        self.stale_from: str | None = None  # the checkpoint they still hold
        self.quantization: str | None = None  # --quantization (online): /server_info's
        self.weights_path = model_path  # the checkpoint whose tensors the parameters hold
        self.updating = False  # token mode: an update with abort_all_requests holds new requests until it is done
        self.server = _Server((host, port), self._handler())
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fake-sglang", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Go down: the port refuses connections from now on."""
        self.server.shutdown()
        self.server.server_close()

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.calls]

    # --- endpoints ------------------------------------------------------------------------------------

    def health_generate(self, body, query):
        return (200, None) if self.healthy else (503, None)

    def model_info(self, body, query):
        info = fixture("model_info.json")["body"]
        return 200, {**info, "model_path": self.model_path, "served_model_name": self.model_path,
                     "weight_version": self.weight_version}

    def server_info(self, body, query):
        return 200, {"enable_deterministic_inference": self.deterministic, "skip_tokenizer_init": True,
                     "quantization": self.quantization, "version": "0.5.23", "tp_size": self.tp_size, "dp_size": 1,
                     "pp_size": 1, "enable_dp_attention": False, "custom_weight_loader": self.custom_weight_loader}

    def get_weights_by_name(self, body, query):
        """0.5.14 entrypoints/http_server.py:1340-1349: the parameter, or 400 "Get parameter by name failed" where
        the model has no read-back or no parameter of that name (model_runner.py:2129-2144 answers None). Launched
        with --quantization fp8 its linear layers hold fp8 weights: their values are not the checkpoint's."""
        name = str(body.get("name"))
        answer = read_back(self.weights_path, name, int(body.get("truncate_size", 100))) if self.readback else None
        if answer is not None and self.quantization == "fp8" and name.endswith("proj.weight"):
            import torch

            answer = torch.tensor(answer).to(torch.float8_e4m3fn).float().tolist()
        return (400, {"error": {"message": "Get parameter by name failed"}}) if answer is None else (200, answer)

    def generate(self, body, query):
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.generate_status:
            status, self.generate_status = self.generate_status, 0
            return status, {"error": {"message": f"fake server failure {status}"}}
        problem = self._contract(body)
        if problem:
            return 400, {"error": {"message": problem}}
        rows, sps, rids = body["input_ids"], body["sampling_params"], body["rid"]
        outs = []
        streamed = self._stream(rows, sps) if self.token_s else None  # (aborted, tokens, logprobs, version, kind)
        sampled = self.sampler(rows, sps) if streamed is None else [(t, lp, kind) for _, t, lp, _, kind in streamed]
        for r, (rid, row, sp, (tokens, logprobs, kind)) in enumerate(zip(rids, rows, sps, sampled)):
            version = self.report_version or self.weight_version
            with self.lock:
                abort, self.abort_rows = self.abort_rows > 0, max(0, self.abort_rows - 1)
            if abort:
                tokens, logprobs = tokens[:1], logprobs[:1]
            if streamed is not None:
                abort, tokens, logprobs, version, _ = streamed[r]
            if abort:
                reason = {"type": "abort", "message": "Aborted by AbortReq." if streamed else "Aborted",
                          "status_code": None, "err_type": None}
            elif kind == "stop" and len(tokens) < sp["max_new_tokens"]:
                reason = {"type": "stop", "matched": tokens[-1]}
            else:  # SGLang checks the limit before the stop tokens: a stop token sampled last is "length" (0.5.14
                # managers/schedule_batch.py:1412, before _check_token_based_finish at 1436)
                reason = {"type": "length", "length": len(tokens)}
            with self.lock:
                unstarted, self.abort_unstarted = self.abort_unstarted > 0, max(0, self.abort_unstarted - 1)
            if unstarted:  # aborted in the waiting queue: 0.5.14 tokenizer_manager.py `_handle_abort_req`
                outs.append({"text": "", "meta_info": {"id": rid, "finish_reason": {
                    "type": "abort", "message": "Abort before prefill"}, "prompt_tokens": 0, "completion_tokens": 0}})
                continue
            with self.lock:  # SGLang's radix cache, flushed at each update: a prompt seen under this version is
                key = (str(self.weight_version), tuple(row))  # held but for its last token
                cached, _ = (len(row) - 1 if key in self.prefixes else 0), self.prefixes.add(key)
            outs.append({"output_ids": list(tokens), "meta_info": {
                "id": rid, "finish_reason": reason, "prompt_tokens": len(row), "weight_version": version,
                "num_retractions": 0, "input_token_logprobs": [],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
                "output_token_logprobs_length": len(tokens), "reasoning_tokens": 0,
                "completion_tokens": len(tokens), "cached_tokens": cached, "e2e_latency": 0.001}})
        return 200, outs

    def pause_generation(self, body, query):
        """Paused, new requests wait until continue (token mode); with mode abort every running request ends with the
        tokens it has sampled, and the answer comes once none runs (0.5.14 tokenizer_manager.py `pause_generation`:
        abort all, until `model_update_lock` is free)."""
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return 400, {"error": {"message": f"invalid pause mode {body.get('mode')!r}"}}
        with self.gate:
            self.paused = True
            if mode == "abort":
                self.aborting = True
                self.gate.notify_all()
                self.gate.wait_for(lambda: self.active == 0)
                self.aborting = False
        return 200, fixture("pause_continue.json")["pause_answer"]

    def continue_generation(self, body, query):
        with self.gate:
            self.paused = False
            self.gate.notify_all()
        return 200, fixture("pause_continue.json")["continue_answer"]

    def _stream(self, rows: list[list[int]], sps: list[dict]) -> list[tuple[bool, list, list, str, str]]:
        """Token mode: the rows sampled (once the server is not paused, as SGLang holds new requests: so under the
        weights they will be labelled with), then their tokens one step of `token_s` at a time, each token's logprob
        the mark of the weight version that made it (`version_logprob`; the sampler's with `mark_versions` off); a
        pause with mode abort ends the rows that have not finished."""
        with self.gate:
            self.gate.wait_for(lambda: not self.paused and not self.updating)
            self.active += 1
            hold = self.hold_at.pop(0) if self.hold_at else None
        made: list[list[float]] = [[] for _ in rows]
        try:
            sampled = self.sampler(rows, sps)
            for step in range(max(len(t) for t, _, _ in sampled)):
                if step == hold:  # held here until a pause aborts the rows (or 30 s pass)
                    self.holding.set()
                    with self.gate:
                        self.gate.wait_for(lambda: self.aborting, 30)
                time.sleep(self.token_s)
                with self.gate:
                    if self.aborting:
                        break
                    mark = version_logprob(self.weight_version)
                for (tokens, sampled_lps, _), lps in zip(sampled, made):
                    if len(lps) < len(tokens):
                        lps.append(mark if self.mark_versions else sampled_lps[len(lps)])
        finally:
            with self.gate:
                self.active -= 1
                self.gate.notify_all()
        version = self.report_version or self.weight_version
        return [(len(lps) < len(t), t[:len(lps)], lps, version, kind) for (t, _, kind), lps in zip(sampled, made)]

    def update_weights_from_disk(self, body, query):
        """With abort_all_requests (token mode) every running request ends with the tokens it has sampled and the
        update waits for them, holding new requests until it is done (0.5.14 tokenizer_manager.py:1694-1725: the
        abort, then `model_update_lock`'s writer lock, which waits for the readers, every running request, and keeps
        new ones out: utils/aio_rwlock.py)."""
        unknown = set(body) - UPDATE_KEYS
        if unknown or "model_path" not in body:
            return 400, {"error": {"message": f"bad UpdateWeightFromDiskReqInput: unknown {sorted(unknown)}"}}
        if not body.get("abort_all_requests"):
            return self._update_from_disk(body)
        with self.gate:
            self.updating = self.aborting = True
            self.gate.notify_all()
            self.gate.wait_for(lambda: self.active == 0)
            self.aborting = False
        try:
            return self._update_from_disk(body)
        finally:
            with self.gate:
                self.updating = False
                self.gate.notify_all()

    def _update_from_disk(self, body):
        f = fixture("update_weights_from_disk.json")
        if self.refuse_update == "load":
            return 400, f["refused_load"]
        if self.params is not None and any(n.endswith("_blocks") for n in self.params):
            # an MXFP4 GPT-OSS server: its experts were repacked at launch, the reload and then the rollback raise
            # KeyError, and the scheduler takes the server down (quantized_checkpoint.json, "mxfp4_reload")
            self.healthy = False
            return DOWN, None
        refused = self._fits(body["model_path"])
        if refused:
            return 400, {"success": False, "message": refused, "num_paused_requests": 0}
        if self.on_update is not None:
            self.on_update(body["model_path"])
        if self.refuse_update == "flush" or (self.busy and body.get("flush_cache", True)):
            return 400, f["refused_flush"]  # the weights were swapped, the version was not recorded
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        self.model_path = body["model_path"]
        if not self.keep_weights:
            self.stale_from, self.weights_path = self.weights_path, body["model_path"]
        return 200, {**f["ok"], "message": f"Succeeded to update model weights. Weight version updated to "
                                           f"{self.weight_version}."}

    def _fits(self, path: str) -> str:
        """SGLang loads an update into the parameters it built at launch: a tensor of another shape is refused
        (the weight loaders assert it), one of another dtype is cast without a word (`cast_silently`)."""
        if self.params is None:
            return ""
        q = fixture("quantized_checkpoint.json")
        for name, (dtype, shape) in (checkpoint_params(path) or {}).items():
            have = self.params.get(name)
            if have is None:
                continue  # "Parameter ... not found in params_dict": a warning, not a refusal
            if have[1] != shape:
                return q["refused_shape"].format(loaded=shape, param=have[1])
            if have[0] != dtype:
                self.cast_silently.append(name)
        return ""

    def update_weights_from_tensor(self, body, query):
        """A registered custom loader called on each rank's model, which holds the checkpoint it last loaded in
        SGLang's layout (the module docstring); an unknown load_format ends the scheduler: the server goes down."""
        unknown = set(body) - TENSOR_KEYS
        payloads = body.get("serialized_named_tensors")
        if unknown or not isinstance(payloads, list) or len(payloads) != self.tp_size:
            return 400, {"success": False, "message": f"bad UpdateWeightsFromTensorReqInput: unknown {sorted(unknown)}"}
        models = models_of(self.weights_path, self.tp_size, self.dtype, self.stale_from, self.stale)
        try:
            run_loader(self.custom_weight_loader, payloads, body.get("load_format"), models)
        except NotImplementedError:
            self.healthy = False
            return DOWN, None
        return 200, {"success": True, "message": "Success"}

    def flush_cache(self, body, query):
        text = fixture("pause_continue.json")
        if self.busy:
            return 400, text["flush_timeout_text"]
        return 200, text["flush_ok_text"]

    def _contract(self, body) -> str:
        rows, sps, rids = body.get("input_ids"), body.get("sampling_params"), body.get("rid")
        if not (isinstance(rows, list) and rows and all(isinstance(r, list) and r for r in rows)):
            return "input_ids should be a list of lists for batch processing."
        if not (isinstance(sps, list) and len(sps) == len(rows)):
            return "sampling_params must be one per row"
        if not (isinstance(rids, list) and len(rids) == len(rows)):
            return "The specified rids length mismatch with the batch_size for batch processing."
        for sp in sps:
            unknown = set(sp) - SAMPLING_KEYS
            if unknown:
                return f"unknown field `{sorted(unknown)[0]}`"
            if sp.get("top_k", -1) == 0:
                return "top_k must be -1 (disable) or at least 1, got 0."
        return ""

    def _handler(self):
        fake = self
        routes = {("GET", "/health_generate"): self.health_generate, ("GET", "/health"): self.health_generate,
                  ("GET", "/model_info"): self.model_info,
                  ("GET", "/server_info"): self.server_info, ("POST", "/generate"): self.generate,
                  ("POST", "/pause_generation"): self.pause_generation,
                  ("POST", "/continue_generation"): self.continue_generation,
                  ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
                  ("POST", "/flush_cache"): self.flush_cache,
                  ("POST", "/get_weights_by_name"): self.get_weights_by_name,
                  ("POST", "/update_weights_from_tensor"): self.update_weights_from_tensor}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else {}
                fake.calls.append((method, parts.path if not parts.query else f"{parts.path}?{parts.query}", body))
                route = routes.get((method, parts.path))
                if route is None:
                    status, answer = 404, {"detail": "Not Found"}
                else:
                    status, answer = route(body, parse_qs(parts.query))
                if status == DOWN:
                    self.close_connection = True
                    threading.Thread(target=fake.stop, daemon=True).start()
                    return
                data = b"" if answer is None else (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(status)
                if answer is not None and not isinstance(answer, str):
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler
