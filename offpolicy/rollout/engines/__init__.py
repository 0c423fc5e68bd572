"""Rollout engines: the protocol every engine implements, and the factory by config name.

An engine holds one weight version at a time. `load` swaps to a `WeightVersion` between batches;
`generate` samples `params.n` responses per prompt and returns, per response, the tokens, the
behaviour logprobs of exactly those tokens (from the temperature-scaled distribution the learner
also scores), and why it ended: "stop" exactly when it ends on a stop token, "length" otherwise. Every engine
stops on the same ids, `model_stop_ids` (the tokenizer's EOS and the model's config.json / generation_config.json
EOS ids) and the request's `params.stop_token_ids` (`request_stops`). The embedded `torch` engine is the first
implementation; SGLang and vLLM implement the same protocol (their HTTP servers share `http_pool`), and
tests/unit/test_contracts.py holds each against it (no caller probes an engine with hasattr/getattr).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from offpolicy.config import Config, ModelConfig
from offpolicy.data.tokenizer import Tokenizer, load_tokenizer
from offpolicy.weights import WeightVersion


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    tokens: np.ndarray  # int32 response token ids (the stop token included when it stopped)
    logprobs: np.ndarray  # float32 behaviour logprob of each token
    finish_reason: str  # "stop" or "length"
    # engine details; a server engine's prefix cache: "prompt_tokens" and "cached_tokens" (of those, the ones its
    # prefix cache held), on each of SGLang's rows, on the first completion of a vLLM request (its n samples share one
    # prefill); `prompt_counts`, summed per generate call by `prefill_counts`
    meta: dict = field(default_factory=dict)
    # the weight version of each token, run-length coded (`wire.versions`), where the engine switched versions in
    # flight (rollout.inflight_updates); [] = every token from the version the engine held when generate began
    version_runs: list = field(default_factory=list)


def prompt_counts(prompt_tokens, cached_tokens) -> dict[str, int]:
    """A completion's `meta` entries for its prompt's prefill: the prompt's tokens and those of them the server's prefix
    cache held, as the server reported them (none where it reported no whole numbers: an older server, or vLLM
    without --enable-prompt-tokens-details)."""
    if isinstance(prompt_tokens, int) and isinstance(cached_tokens, int) and 0 <= cached_tokens <= prompt_tokens:
        return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens}
    return {}


def prefill_counts(groups: list[list[Completion]]) -> tuple[int, int] | None:
    """(prompt tokens computed, prompt tokens the prefix cache held) of one generate call's completions, summed over
    those that report them (`prompt_counts`); None where none does (the torch engine, an older server). What a call
    computed in prefill sets much of its time: a prompt's n samples sharing its prefill compute it once."""
    said = [c.meta for g in groups for c in g if "cached_tokens" in c.meta]
    if not said:
        return None
    cached = sum(m["cached_tokens"] for m in said)
    return sum(m["prompt_tokens"] for m in said) - cached, cached


class RolloutEngine(Protocol):
    version: int  # weight version now loaded (-1 before the first load)
    aborted: int  # samples the servers aborted and the engine generated again, since start (0 where none can be)
    last_loads: list[dict]  # one record per server of the last `load` (method, verified); [] for an embedded engine

    def load(self, weights: WeightVersion) -> float:
        """Swap to `weights`; returns the seconds the swap took."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        """`params.n` completions for each prompt, in prompt order; `seeds` (one per prompt) make each
        prompt's samples reproducible whatever the batch or daemon."""

    def interrupt(self) -> None:
        """The daemon stops: end the engine's own waits now (vLLM's wait for a restarted server); thread-safe."""

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` once, from another thread, if the engine is lost for good mid-run (the in-process
        SGLang engine's scheduler died: `sglang/sigquit.py`); its generate and load then raise `EngineLost`, and the
        daemon stops with exit code 1. Engines that are never lost that way keep the callback and never call it."""

    def close(self) -> None:
        """Release the servers or the in-process engine."""


class Prefetcher(Protocol):
    """An engine's background loader (`rollout.double_buffer`: the torch engine's `double_buffer.DoubleBuffer`):
    the daemon hands it each version it hears of; the engine's `load` then only swaps it in."""

    def prefetch(self, weights: WeightVersion) -> None:
        """Start reading `weights` in the background; returns at once (a newer request replaces an older one)."""

    def drain(self) -> list:
        """What became of the requests since the last call (`double_buffer.PrefetchRecord`s)."""

    def close(self) -> None:
        """Stop reading."""


def prefetcher_of(cfg: Config, engine: RolloutEngine) -> Prefetcher | None:
    """The engine's background loader where `rollout.double_buffer` is on (the torch engine: the next version's
    weights; vLLM servers over HTTP: the next version staged or its files hashed for the load's proof; the in-process
    SGLang engine: the next version staged on its GPU (rollout.sglang.prefetch=device) or its files hashed for the
    load's proof), else None (every load is then done whole by `load`, on the critical path)."""
    if cfg.rollout.engine in ("torch", "vllm", "sglang"):
        return engine.prefetcher
    return None


def samples_first(count: int, group: int) -> list[int]:
    """The order to send `count` rows in that come as consecutive groups of `group` (a prompt's samples, each a row of
    its own): every group's first row, then every group's second, and so on. SGLang's scheduler takes its waiting
    requests first come first served once more than 128 wait (0.5.14 `schedule_policy._determine_active_policy`; its
    in-batch prefix sharing only runs under the cache-aware policy below that), so a prompt's samples sent side by side
    are prefilled in one batch, each computing the whole prompt; sent this way the first samples of the prompts are
    prefilled first and the rest find their prompt in the prefix cache."""
    return [start + k for k in range(group) for start in range(0, count, group) if start + k < count]


def sent_samples_first(call: Callable[[list, list], list], rows: list, sampling: list, group: int) -> list:
    """`call(rows, sampling)` with the rows sent in `samples_first` order; its answers put back in row order (an
    answer that is not one list entry per row is returned as it came, for the caller to refuse)."""
    order = samples_first(len(rows), group)
    outs = call([rows[i] for i in order], [sampling[i] for i in order])
    if not isinstance(outs, list) or len(outs) != len(rows):
        return outs
    back: list = [None] * len(rows)
    for pos, i in enumerate(order):
        back[i] = outs[pos]
    return back


def prompt_seed(seed: int, epoch: int, prompt_id: int) -> int:
    """The sampling seed of one prompt under `rollout.seed_per_prompt`."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + prompt_id) % (1 << 62)


def sample_seed(prompt_seed: int, index: int) -> int:
    """The seed of the `index`-th sample of a prompt (one request row per sample; a signed 64-bit seed)."""
    return (prompt_seed * 1_000_003 + index) % (1 << 63)


def model_stop_ids(model: ModelConfig, tokenizer_eos: int) -> frozenset[int]:
    """The ids every engine ends a response on for `model`, beside a request's `params.stop_token_ids`: the
    tokenizer's EOS and the `eos_token_id` (an int or a list) of `model.path`'s config.json and of its
    generation_config.json, both (GPT-OSS's lists <|return|>, <|endoftext|> and <|call|>). SGLang stops on the union
    of the two files by itself (0.5.14 `configs/model_config.py:1459-1477`); vLLM on generation_config.json's, or
    config.json's where there is none (0.32 `v1/engine/input_processor.py:489-492`, `sampling_params.py:786-797`,
    `transformers_utils/config.py:1212-1238`), so each engine is sent the whole set and the torch engine stops on
    it. A model built from `model.arch` has the eos of the config that arch builds (what the servers' launch
    checkpoint and every version's config.json then hold: its model type's default where the arch gives none,
    llama's 2); a `model.path` that is no local directory (a hub id), or a file missing or unreadable, adds nothing."""
    ids = {tokenizer_eos}
    if model.path is None:
        return frozenset(ids | set(_eos_list(_arch_eos(model.arch))))
    for name in ("config.json", "generation_config.json"):
        try:
            ids.update(_eos_list(json.loads((Path(model.path) / name).read_text()).get("eos_token_id")))
        except (OSError, ValueError, AttributeError):
            continue
    return frozenset(ids)


def response_tokenizer(model: ModelConfig) -> Tokenizer:
    """`model.tokenizer`, decoding a response up to the first id an engine stops on (`model_stop_ids`): the text a
    reward or an evaluation grades."""
    tokenizer = load_tokenizer(model.tokenizer)
    return tokenizer.stop_at(model_stop_ids(model, tokenizer.eos_token_id))


def _eos_list(value) -> list[int]:
    """An `eos_token_id` field (None, an int or a list) as a list of ids."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _arch_eos(arch: dict):
    """The `eos_token_id` of the HF config `model.arch` builds (its model type's default where the arch gives none)."""
    if "eos_token_id" in arch or "model_type" not in arch:
        return arch.get("eos_token_id")
    from transformers import AutoConfig

    rest = {k: v for k, v in arch.items() if k != "model_type"}
    return AutoConfig.for_model(arch["model_type"], **rest).eos_token_id


def request_stops(stop_ids: Collection[int], params: SamplingParams, prompts: list,
                  seeds: list[int] | None) -> list[int]:
    """The stop token ids of a generate call (the model's, `model_stop_ids`, and params.stop_token_ids), after
    checking one seed per prompt."""
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    return sorted({*stop_ids, *params.stop_token_ids})


def make_engine(cfg: Config, seed: int = 0) -> RolloutEngine:
    if cfg.rollout.engine == "torch":
        from offpolicy.rollout.engines.torch_engine import TorchEngine

        return TorchEngine(cfg, seed=seed)
    if cfg.rollout.engine == "sglang":
        from offpolicy.rollout.engines.sglang import SGLangEngine

        return SGLangEngine(cfg, seed=seed)
    if cfg.rollout.engine == "vllm":
        from offpolicy.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(cfg, seed=seed)
    raise ValueError(f"rollout.engine {cfg.rollout.engine!r} is not available")
