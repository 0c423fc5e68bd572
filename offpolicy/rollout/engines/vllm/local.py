"""vLLM inside the rollout daemon: `vllm.LLM` (the offline engine), started on the first version it loads.

Starting on a version directory (not model.path) lets a model built from `model.arch` run, and makes
the engine's start-up load the fingerprint baseline of that version. `LocalBackend` answers the same
JSON-like shapes as the HTTP servers (`_choices`), so `VLLMEngine` parses one format. Generation and
swaps never overlap: the daemon calls them one after the other, and `LLM.generate` blocks until its
batch is done. Imports vLLM only when the engine starts.
"""

from __future__ import annotations

import os
import time
from typing import Any

from offpolicy.config import Config
from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.staging import map_versions
from offpolicy.rollout.engines.vllm.versions import version_salt
from offpolicy.rollout.engines.vllm.wire import ENV, engine_args, load_methods, load_until_proven, offset_of


def _choices(output: Any) -> dict:
    """A vllm RequestOutput as the tokens API's JSON shape ({"choices": [...]})."""
    choices = []
    for c in output.outputs:
        content = [{"token_id": t, "logprob": (lp or {}).get(t).logprob if (lp or {}).get(t) is not None else None}
                   for t, lp in zip(c.token_ids, c.logprobs or [None] * len(c.token_ids))]
        spans = [{"version": s.version, "start": s.start, "end": s.end} for s in (getattr(c, "weight_versions", None) or [])]
        choices.append({"index": c.index, "finish_reason": c.finish_reason, "token_ids": list(c.token_ids),
                        "logprobs": {"content": content}, "weight_versions": spans})
    cached = getattr(output, "num_cached_tokens", None)  # the prefill, as the servers' `usage` gives it
    return {"choices": choices, "usage": {"prompt_tokens": len(output.prompt_token_ids or []),
                                          "prompt_tokens_details": {"cached_tokens": cached}}}


class LocalBackend:
    output_versions = False  # one engine, swapped between generate calls: no labels to check

    def __init__(self, cfg: Config, seed: int, on_cpu: bool):
        self.cfg, self.seed, self.on_cpu = cfg, seed, on_cpu
        self.llm = None
        self.version: int | None = -1
        self.offset: int | None = None
        self.rebuild = False  # an in-place load failed the check once: rebuild from then on
        self.held: dict = {}  # the reports of the last proven load (or the baseline's): wire.load_until_proven
        self.swaps: list[dict] = []

    def _start(self, path: str) -> None:
        os.environ.update(ENV)  # the plugin reads it in vLLM's worker processes, which inherit it
        if not self.on_cpu:  # the daemon has CUDA up (its stagings): a forked engine core could not use the GPU
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM  # late: heavy

        self.llm = LLM(**engine_args(self.cfg, path, self.seed, self.on_cpu))
        if self.cfg.rollout.vllm.verify:
            self.held["reports"] = self._rpc("offpolicy_baseline", {})
            self.offset = offset_of(self.held["reports"])

    def _rpc(self, method: str, kwargs: dict) -> list[dict]:
        import json

        return [json.loads(r) for r in self.llm.collective_rpc(method, kwargs=kwargs)]

    def generate(self, rows: list[list[int]], sampling: list[dict], group: int, version: int) -> list[dict]:
        if self.llm is None:
            raise WeightUpdateError("the in-process vLLM engine has no weights yet: it starts on its first version; "
                                    "load one before generating")
        if self.version != version:
            raise WeightUpdateError(f"the in-process vLLM engine holds weight version {self.version}, not {version}: "
                                    "its last load failed; load a version again")
        from vllm import SamplingParams, TokensPrompt

        salt = version_salt(version)  # no prompt reuses another version's KV blocks: no cache reset at a swap
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r, cache_salt=salt) for r in rows],
                                 [SamplingParams(**sp) for sp in sampling], use_tqdm=False)
        return [_choices(o) for o in outs]

    def update_weights(self, path: str, version: int) -> None:
        t0 = time.perf_counter()
        if self.llm is None:
            self._start(path)
            record = {"method": "start", "verified": False}
        else:
            record = self._load(path, version)
        self.version = version
        record["seconds"] = time.perf_counter() - t0
        self.swaps.append(record)

    def _load(self, path: str, version: int) -> dict:
        v = self.cfg.rollout.vllm
        maps = map_versions(self.cfg.weights)
        record = load_until_proven(lambda method: self._rpc("offpolicy_load", {"path": path, "method": method,
                                                                                "stage": v.prefetch, "maps": maps,
                                                                                "threads": v.stage_threads}),
                                   load_methods(v.load_method, self.rebuild), lambda: self.offset, v.verify,
                                   "the in-process vLLM engine", version, self.held)
        if record is None:
            self.version = None
            raise WeightUpdateError(f"after loading version {version} from {path} the vLLM engine's tensors are not the "
                                    "version's (fingerprint check): it generates no more until a load succeeds; see "
                                    "docs/vllm.md")
        self.rebuild = self.rebuild or record["method"] == "rebuild"
        return record

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes now (not at interpreter exit)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
