"""What goes to SGLang and what comes back: request building, response parsing, and the errors.

Pure functions over the JSON shapes of sglang 0.5.23 (file:line in docs/sglang.md), shared by the
HTTP and the in-process backend. Invariants:
- one request row is one sample (`n` is always 1; we repeat a prompt `n` times ourselves, so every
  sample can carry its own `sampling_seed` and SGLang's prefix cache still shares the prompt);
- tokens and behaviour logprobs both come from `meta_info["output_token_logprobs"]`, one
  `(logprob, token_id, text)` triple per generated token, the stop token included (`no_stop_trim`);
- a sample is returned only if it finished with "stop" or "length" under the weight version we
  expect; "abort" is reported to the caller (who retries), anything else raises;
- a returned sample's finish reason is "stop" exactly when its last token is a stop token, as the other
  engines report it: SGLang checks the length limit before the stop tokens (0.5.14
  `managers/schedule_batch.py:1412` `update_finish_state`, before `_check_token_based_finish` at 1436), so a
  stop token sampled as the `max_new_tokens`-th token comes back as "length" and is reported here as "stop";
  a "stop" must end on the token it matched (`FINISH_MATCHED_TOKEN`, 154-161), and one on a string (SGLang's
  "NaN happened" for an id outside the vocabulary, 1387-1400; we send no stop strings) raises.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from offpolicy.rollout.engines import (  # noqa: F401  (sample_seed: re-exported)
    Completion,
    SamplingParams,
    prompt_counts,
    sample_seed,
)
from offpolicy.rollout.engines.http_pool import error_message  # noqa: F401  (re-exported)
from offpolicy.rollout.engines.errors import (
    EngineError,
    RequestRefused,
    RetriesExhausted,
    ServerUnavailable,
    VersionMismatch,
    WeightUpdateError,
)


SGLangError = EngineError  # the engines' common base (offpolicy/rollout/engines/errors.py), by its older name


def sampling_params(params: SamplingParams, stop_token_ids: list[int], seed: int | None = None) -> dict[str, Any]:
    """SGLang `sampling_params` of one sample. Our top_k 0 (off) is SGLang's -1 (whole vocabulary)."""
    sp: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "n": 1,
        "stop_token_ids": sorted(stop_token_ids),
        "no_stop_trim": True,
    }
    if seed is not None:
        sp["sampling_seed"] = seed
    return sp


def samples_sampling(params: SamplingParams, stop_token_ids: list[int], prompts: int,
                     seeds: list[int] | None) -> list[dict[str, Any]]:
    """The `sampling_params` of every sample of `prompts` prompts, prompt-major (`params.n` each), each sample with its
    own seed where the prompts have seeds."""
    return [sampling_params(params, stop_token_ids, None if seeds is None else sample_seed(seeds[j], i))
            for j in range(prompts) for i in range(params.n)]


def generate_body(rows: list[list[int]], sampling: list[dict[str, Any]], rids: list[str]) -> dict[str, Any]:
    """A batched, non-streaming `/generate` request (GenerateReqInput): one row per sample."""
    if not (len(rows) == len(sampling) == len(rids)) or not rows:
        raise ValueError(f"{len(rows)} rows, {len(sampling)} sampling params, {len(rids)} rids: need equal, >= 1")
    return {"input_ids": rows, "sampling_params": sampling, "return_logprob": True, "rid": rids, "stream": False}


def finish_type(out: dict[str, Any]) -> str:
    """`meta_info.finish_reason.type` of one output: "stop", "length" or "abort"."""
    reason = _meta(out).get("finish_reason")
    if not isinstance(reason, dict) or not isinstance(reason.get("type"), str):
        raise SGLangError(f"SGLang output {_rid(out)} has no finish_reason.type: {reason!r}")
    return reason["type"]


def abort_message(out: dict[str, Any]) -> str:
    reason = _meta(out).get("finish_reason") or {}
    return str(reason.get("message") or "aborted")


def parse_output(out: dict[str, Any], expected_version: str | None, stops: Collection[int]) -> Completion | None:
    """The Completion of one SGLang output, or None when SGLang aborted it (the caller retries).

    `expected_version` is the `weight_version` string the sample must carry (None: not checked,
    before the engine's first load); a different version, or spans of several, raise VersionMismatch.
    `stops`: the stop token ids SGLang stops on (those sent, and the model's EOS ids where known): a "length"
    output whose last token is one of them stopped (the module docstring).
    """
    kind = finish_type(out)
    if kind == "abort":
        return None
    if kind not in ("stop", "length"):
        raise SGLangError(f"SGLang output {_rid(out)} finished with unknown reason {kind!r}")
    meta = _meta(out)
    if expected_version is not None:
        spans = meta.get("weight_versions") or [{"version": meta.get("weight_version")}]
        seen = [str(s.get("version")) for s in spans]
        if str(meta.get("weight_version")) != expected_version or any(v != expected_version for v in seen):
            raise VersionMismatch(f"SGLang output {_rid(out)} was generated with weight version(s) {seen}, the engine "
                                  f"loaded {expected_version}: is another client updating this server's weights?")
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list) or not triples:
        raise SGLangError(f"SGLang output {_rid(out)} has no output_token_logprobs: was return_logprob sent?")
    tokens, logprobs = _sampled(out, triples)
    ids = out.get("output_ids")
    if ids is not None and list(ids) != tokens.tolist():
        raise SGLangError(f"SGLang output {_rid(out)}: output_ids {list(ids)[:8]}... differ from the token ids of "
                          f"output_token_logprobs {tokens[:8].tolist()}...")
    kind = _finish_kind(out, kind, int(tokens[-1]), stops)
    return Completion(tokens=tokens, logprobs=logprobs, finish_reason=kind, meta=answer_meta(out))


def answer_meta(out: dict[str, Any]) -> dict[str, Any]:
    """What a completion keeps of an answer's `meta_info`: SGLang's id and the prompt's prefill counts."""
    meta = _meta(out)
    return {"sglang_id": meta.get("id"), **prompt_counts(meta.get("prompt_tokens"), meta.get("cached_tokens"))}


def partial_output(out: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and behaviour logprobs an aborted output had sampled (none where it was aborted before its prefill:
    SGLang then sends no `output_token_logprobs`), for its continuation (rollout.inflight_updates)."""
    return _sampled(out, _meta(out).get("output_token_logprobs") or [])


def _sampled(out: dict[str, Any], triples: list) -> tuple[np.ndarray, np.ndarray]:
    """The token ids and finite float32 logprobs of `output_token_logprobs` triples; malformed or non-finite ones
    raise."""
    try:
        logprobs = np.array([t[0] for t in triples], dtype=np.float32)
        tokens = np.array([t[1] for t in triples], dtype=np.int32)
    except (TypeError, IndexError, ValueError) as e:
        raise SGLangError(f"SGLang output {_rid(out)} has malformed output_token_logprobs: {e}") from None
    if not np.isfinite(logprobs).all():
        raise SGLangError(f"SGLang output {_rid(out)} has non-finite logprobs")
    return tokens, logprobs


def weight_label(out: dict[str, Any]) -> str:
    """The `weight_version` SGLang reports an output with (set when the output is made: `meta_info`)."""
    return str(_meta(out).get("weight_version"))


def _finish_kind(out: dict[str, Any], kind: str, last: int, stops: Collection[int]) -> str:
    """"stop" when the output ends on a stop token, else "length" (the module docstring)."""
    if kind == "length":
        return "stop" if last in stops else "length"
    matched = _meta(out)["finish_reason"].get("matched")
    if isinstance(matched, str):
        raise SGLangError(f"SGLang output {_rid(out)} stopped on the string {matched!r}, not a stop token ('NaN "
                          "happened': it sampled an id outside the vocabulary and replaced it; NaN logits?)")
    ids = matched if isinstance(matched, list) else [] if matched is None else [matched]  # Union[int, List[int]]
    if last not in (ids or stops):
        raise SGLangError(f"SGLang output {_rid(out)} stopped (matched {matched!r}) but ends on token {last}, not the "
                          f"stop token: was no_stop_trim dropped?")
    # a matched id not in `stops`: an EOS of a model config SGLang added (model_config.py:1459) that was not readable
    # here (servers started on a hub id, or elsewhere); with skip_tokenizer_init SGLang has no tokenizer stop ids
    return "stop"


def _meta(out: dict[str, Any]) -> dict[str, Any]:
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        raise SGLangError(f"SGLang output has no meta_info: {str(out)[:200]}")
    return meta


def _rid(out: dict[str, Any]) -> str:
    meta = out.get("meta_info") if isinstance(out, dict) else None
    return repr(meta.get("id")) if isinstance(meta, dict) else "?"
