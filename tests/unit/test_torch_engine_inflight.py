"""Tests for the torch engine's weight updates in flight (`rollout.inflight_updates`): a newer version ready in
the double buffer is swapped in between two decode steps of one generation, every token carries the version
that produced it, and each behaviour logprob is the one a reference forward of that version gives (the prompt
and earlier tokens' keys and values from the older version, as the engine's KV cache keeps them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.config import ConfigError, load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.torch_engine import TorchEngine, inflight_updates
from offpolicy.weights import WeightStore, WeightVersion
from offpolicy.wire.protocol import VersionRun

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 9, 8, 7, 6, 5, 12]]
SAMPLING = SamplingParams(n=3, temperature=1.0, max_new_tokens=24)
SEEDS = [5, 6, 7]
SWITCH = 9  # the decode step (first token index) at which version 2 takes over


def config(*overrides: str):
    return load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", "rollout.max_new_tokens=24",
                                    *overrides])


def version_model(v: int):
    return build_model(config(f"model.seed={6 + v}").model, torch.device("cpu"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Versions 1 and 2 of the quickstart model (seeds 7 and 8): different weights, different logprobs."""
    store = WeightStore(str(tmp_path_factory.mktemp("store")), "inflight", keep=10)
    for v in (1, 2):
        model = version_model(v)
        store.publish(v, hf_state(model), hf_config(model))
    return store


def held(store, version: int) -> WeightVersion:
    return WeightVersion(Path(store.root) / store.run / f"v{version}")


def switch_at(engine: TorchEngine, store, step: int, version: int) -> list[int]:
    """Make `version` ready in the spare exactly when the engine asks for the `step`-th time (decode step `step`:
    its first token index): the read is asked for and awaited there, so the switch happens at that step and no
    earlier, whatever the machine's speed. Returns the token indices the engine asked at."""
    buf = engine.prefetcher
    take, asked = buf.take_ready, []

    def hooked(newer_than: int):
        asked.append(len(asked) + 1)
        if len(asked) == step:
            with held(store, version) as wv:
                buf.prefetch(wv)
            assert buf.wait_ready(version, 60.0)
        return take(newer_than)

    buf.take_ready = hooked
    return asked


def reference_logprobs(v1, v2, prompt: list[int], tokens: np.ndarray, switch: int) -> np.ndarray:
    """Behaviour logprobs as the engine's mixed cache makes them: version 1 reads the prompt and tokens before
    `switch - 1` and gives the logits of tokens 0 .. switch - 1; version 2 reads the rest (from token switch - 1
    on, with version 1's cache) and gives the logits of tokens switch ...; no padding, no batching."""
    ids = torch.tensor([prompt + tokens.tolist()])
    cut = len(prompt) + min(switch, len(tokens)) - 1
    with torch.no_grad():
        first = v1(input_ids=ids[:, :cut], use_cache=True)
        logits = [first.logits[0]]
        if cut < ids.shape[1] - 1:
            rest = v2(input_ids=ids[:, cut:-1], past_key_values=first.past_key_values, use_cache=True)
            logits.append(rest.logits[0])
    logp = torch.log_softmax(torch.cat(logits).float(), dim=-1)[len(prompt) - 1:]
    return logp.gather(-1, torch.as_tensor(tokens, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def plain_logprobs(model, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.as_tensor(tokens, dtype=torch.long)[:, None]).squeeze(-1).numpy()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic_cache", "static_cache"])
def test_a_generation_switches_version_at_a_decode_step_and_each_token_keeps_its_version(store, static):
    engine = TorchEngine(config("rollout.inflight_updates=true", f"rollout.static_cache={str(static).lower()}"),
                         seed=0)
    assert engine.inflight and engine.prefetcher is not None  # inflight_updates=true turns the double buffer on
    with held(store, 1) as wv:
        engine.load(wv)
    asked = switch_at(engine, store, SWITCH, 2)
    groups = engine.generate(PROMPTS, SAMPLING, seeds=SEEDS)
    assert engine.version == 2 and asked[:SWITCH] == list(range(1, SWITCH + 1))
    v1, v2 = version_model(1), version_model(2)
    switched = 0
    for prompt, comps in zip(PROMPTS, groups):
        for c in comps:
            n = len(c.tokens)
            expected = [VersionRun(0, 1), VersionRun(SWITCH, 2)] if n > SWITCH else [VersionRun(0, 1)]
            assert c.version_runs == expected, (n, c.version_runs)
            ref = reference_logprobs(v1, v2, prompt, c.tokens, SWITCH)
            np.testing.assert_allclose(c.logprobs, ref, atol=1e-5, rtol=0)
            if n > SWITCH + 1:
                switched += 1
                # the tokens after the switch are not version 1's: a pure version-1 forward scores them otherwise
                assert np.abs(plain_logprobs(v1, prompt, c.tokens)[SWITCH:] - c.logprobs[SWITCH:]).max() > 1e-3
    assert switched >= 3, "too few responses ran past the switch to test it"
    # the buffer recorded the swap as an in-flight one (the swapper traces it as a load)
    records = engine.prefetcher.drain()
    assert [(r.version, r.outcome, r.inflight) for r in records if r.version == 2] == [(2, "swapped", True)]
    engine.close()


def loaded_with_ready(store, loaded: int, ready: int, *overrides: str) -> TorchEngine:
    """An engine holding version `loaded`, with version `ready` read completely into its spare weights."""
    engine = TorchEngine(config(*overrides), seed=0)
    with held(store, loaded) as wv:
        engine.load(wv)
    with held(store, ready) as wv:
        engine.prefetcher.prefetch(wv)
    assert engine.prefetcher.wait_ready(ready, 60.0)
    return engine


def test_without_inflight_updates_a_ready_version_waits_for_the_next_generate_call(store):
    engine = loaded_with_ready(store, 1, 2, "rollout.double_buffer=true", "rollout.inflight_updates=false")
    assert not engine.inflight
    groups = engine.generate(PROMPTS, SAMPLING, seeds=SEEDS)
    assert engine.version == 1 and engine.prefetcher.ready == 2
    assert all(c.version_runs == [VersionRun(0, 1)] for comps in groups for c in comps)
    v1 = version_model(1)
    for prompt, comps in zip(PROMPTS, groups):
        for c in comps:
            np.testing.assert_allclose(c.logprobs, plain_logprobs(v1, prompt, c.tokens), atol=1e-5, rtol=0)
    engine.close()


def test_an_older_or_equal_ready_version_is_never_switched_to(store):
    engine = loaded_with_ready(store, 2, 1, "rollout.inflight_updates=true")
    groups = engine.generate(PROMPTS, SAMPLING, seeds=SEEDS)
    assert engine.version == 2 and all(c.version_runs == [VersionRun(0, 2)] for comps in groups for c in comps)
    engine.close()


def test_inflight_updates_resolution():
    assert inflight_updates("auto", True, False) is True  # where the double buffer is on
    assert inflight_updates("auto", False, False) is False
    assert inflight_updates(True, True, False) is True
    assert inflight_updates(False, True, False) is False
    assert inflight_updates("auto", True, True) is False  # a captured CUDA graph reads the weights it captured
    with pytest.raises(ValueError, match="rollout.inflight_updates is true, but the decode step is a captured CUDA"):
        inflight_updates(True, True, True)


@pytest.mark.parametrize("path, overrides, why", [
    ("quickstart-vllm.yaml", ["rollout.vllm.mode=engine"],
     "only the torch engine and vLLM or SGLang servers over HTTP switch weight versions during a generation "
     "(rollout.engine is vllm, mode engine"),
    ("gptoss20b-sglang.yaml", ["rollout.sglang.mode=engine"], "only the torch engine and vLLM or SGLang servers over "
                                                              "HTTP switch weight versions during a generation "
                                                              "(rollout.engine is sglang, mode engine"),
    ("quickstart.yaml", ["rollout.double_buffer=false"], "rollout.double_buffer is false"),
])
def test_inflight_updates_true_is_refused_where_it_cannot_run(path, overrides, why):
    with pytest.raises(ConfigError, match="config field rollout.inflight_updates") as e:
        load_config(str(REPO / "configs" / path), ["rollout.inflight_updates=true", *overrides])
    assert why in str(e.value)


@pytest.mark.parametrize("path", ["quickstart-vllm.yaml", "gptoss20b-sglang.yaml"])
def test_inflight_updates_auto_is_accepted_with_server_engines(path):
    assert load_config(str(REPO / "configs" / path), []).rollout.inflight_updates == "auto"


def test_inflight_updates_true_is_accepted_for_vllm_servers():
    cfg = load_config(str(REPO / "configs" / "quickstart-vllm.yaml"), ["rollout.inflight_updates=true"])
    assert cfg.rollout.inflight_updates is True and cfg.rollout.vllm.mode == "http"
