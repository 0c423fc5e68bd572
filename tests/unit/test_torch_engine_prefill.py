"""The torch engine's prefill computes logits at each row's last prompt position only: the lm_head's input has one
position in every call (prefill and decode, dynamic and static cache, a dense model and GPT-OSS), and the samples
and behaviour logprobs are those of a prefill that computes logits at every prompt position (the engine before)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.torch_engine import TorchEngine
from tests.conftest import QUICKSTART
from tests.unit.test_torch_engine_lowbit import GPT_OSS

BOS, EQ = 11, 12
PROMPTS = [[BOS, 1, 2, 3, 4, 5, 6, 7, 8, EQ], [BOS, 7, EQ], [BOS, 9, 8, 7, 6, EQ]]  # left padding: 7 and 4 positions
SETUPS = {"dynamic": ["rollout.static_cache=false"], "static": ["rollout.static_cache=true"],
          "gpt_oss": ["rollout.static_cache=false", "model.arch=" + json.dumps(GPT_OSS)]}


def engine(setup: str) -> TorchEngine:
    return TorchEngine(load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", *SETUPS[setup]]), seed=0)


def lm_head_positions(eng: TorchEngine, prompts, params, seeds) -> tuple[list[int], list]:
    """(the sequence length of the lm_head's input in each call, the completions) of one generate call."""
    seen: list[int] = []
    hook = eng.model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
    try:
        out = eng.generate(prompts, params, seeds=seeds)
    finally:
        hook.remove()
    return seen, out


@pytest.mark.parametrize("setup", list(SETUPS))
def test_prefill_runs_the_lm_head_on_the_last_prompt_position_only(setup):
    eng = engine(setup)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5)
    seen, out = lm_head_positions(eng, PROMPTS, params, seeds=[1, 2, 3])
    assert max(len(p) for p in PROMPTS) > 1
    assert seen and set(seen) == {1}, seen  # before: the prefill's call had every prompt position (10 here)
    assert all(len(c.tokens) >= 1 for comps in out for c in comps)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_samples_and_logprobs_are_those_of_a_prefill_with_every_positions_logits(setup, monkeypatch):
    eng = engine(setup)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6)
    seeds = [5, 6, 7]
    last_only = eng.generate(PROMPTS, params, seeds=seeds)
    forward = eng.model.forward

    def every_position(*args, **kwargs):  # the engine before: logits at each prompt position, the last one sampled
        kwargs["logits_to_keep"] = 0
        return forward(*args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", every_position)
    seen, full = lm_head_positions(eng, PROMPTS, params, seeds)
    assert max(seen) == max(len(p) for p in PROMPTS)  # the reference did compute every prompt position
    for a_comps, b_comps in zip(last_only, full):
        for a, b in zip(a_comps, b_comps):
            assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)



def test_chunk_tokens_keeps_one_forward_while_the_scores_fit_and_chunks_past_them():
    from offpolicy.rollout.engines.prefill import QUANTUM, chunk_tokens, spans

    assert chunk_tokens(3, 4, 10) == 10  # the quickstart's: one forward, as before
    gib = 1 << 30
    # the H200's colocated GPT-OSS slice: 256 rows x 64 heads x 500 positions, 32 GB a float32 copy
    c = chunk_tokens(256, 64, 500)
    assert c % QUANTUM == 0 and QUANTUM <= c < 500 and 256 * 64 * c * 501 * 4 <= gib
    assert chunk_tokens(256, 64, 500, setting=100) == 100 and chunk_tokens(3, 4, 10, setting=64) == 10
    assert chunk_tokens(256, 64, 500, eager=False) == 500  # sdpa holds no score matrix: one forward
    assert chunk_tokens(256, 64, 500, setting=100, eager=False) == 100  # a setting holds whatever the attention
    assert chunk_tokens(100_000, 64, 8192) == QUANTUM  # never fewer than QUANTUM positions, whatever the budget
    assert spans(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)] and spans(10, 10) == [(0, 10)]


@pytest.mark.parametrize("setup", ["dynamic", "gpt_oss"])
def test_a_prefill_in_chunks_samples_what_one_forward_samples(setup):
    """Chunks of 3 positions over 10-wide left-padded prompts (the first chunk all padding for two rows); GPT-OSS with
    a 4-token sliding window, so its sliding layers' cache is cut between chunks."""
    window = ["model.arch.sliding_window=4"] if setup == "gpt_oss" else []
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6)
    seeds = [5, 6, 7]
    whole = TorchEngine(load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", *SETUPS[setup], *window]),
                        seed=0)
    chunked = TorchEngine(load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", *SETUPS[setup], *window,
                                                   "rollout.prefill_chunk_tokens=3"]), seed=0)
    chunked.model.load_state_dict(whole.model.state_dict())
    seen_whole, a = lm_head_positions(whole, PROMPTS, params, seeds)
    seen_chunked, b = lm_head_positions(chunked, PROMPTS, params, seeds)
    assert len(seen_chunked) == len(seen_whole) + 3  # four prefill forwards instead of one
    for a_comps, b_comps in zip(a, b):
        for x, y in zip(a_comps, b_comps):
            assert x.tokens.tolist() == y.tokens.tolist() and x.finish_reason == y.finish_reason
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-4)
