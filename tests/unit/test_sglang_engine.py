"""SGLangEngine in http mode against stand-in SGLang servers (tests/sglang_fake.py) on loopback:
generation, load balancing, the pause/update/continue sequence and every error path."""

from __future__ import annotations

import time

import pytest

from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.sglang.wire import (
    RequestRefused,
    RetriesExhausted,
    SGLangError,
    ServerUnavailable,
    VersionMismatch,
    WeightUpdateError,
)
from tests.sglang_fake import FakeSGLang
from tests.sglang_http import EOS, engine, fakes, loaded, store  # noqa: F401  (fixtures)

PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=5)
PROMPTS = [[11, 1, 2, 3, 12], [11, 4, 5, 12], [11, 7, 12]]


def generates(fake: FakeSGLang) -> list[dict]:
    return [body for _, path, body in fake.calls if path == "/generate"]


# --- generation -------------------------------------------------------------------------------------


def test_generate_returns_n_completions_per_prompt_in_order(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url)
    groups = e.generate(PROMPTS, PARAMS)
    assert [len(g) for g in groups] == [4, 4, 4]
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert c.finish_reason == "stop" and c.tokens[-1] == EOS
            assert c.tokens.tolist() == [(sum(prompt) + k) % 10 for k in range(4)] + [EOS]
            assert c.logprobs.tolist() == [-0.125 * (k + 1) for k in range(5)]
    (body,) = generates(fake)  # n rows a prompt, sent sample-major: every prompt's first sample, then every second,
    # ...: SGLang prefills each prompt once and the rest find it in its prefix cache (`samples_first`)
    assert body["input_ids"] == [p for _ in range(4) for p in PROMPTS]
    said = [c.meta for g in groups for c in g]  # and the answers come back to their prompts, with what each prefilled
    assert [m["cached_tokens"] for m in said] == [0, 4, 4, 4, 0, 3, 3, 3, 0, 2, 2, 2], said  # the fake's prefix cache
    assert all(sp["n"] == 1 and sp["stop_token_ids"] == [EOS] and sp["top_k"] == -1 for sp in body["sampling_params"])
    assert body["return_logprob"] is True and len(set(body["rid"])) == 12


def test_extra_stop_tokens_join_eos_and_length_finishes_are_kept(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url)
    (group,) = e.generate([[11, 1]], SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(4,)))
    assert generates(fake)[0]["sampling_params"][0]["stop_token_ids"] == [4, EOS]
    assert [c.tokens.tolist()[-1] for c in group] == [4, 4]


def test_seeds_become_one_sampling_seed_per_sample(fakes):
    (fake,) = fakes(deterministic=True)
    e = engine(fake.url, **{"rollout.seed_per_prompt": "true"})
    a = e.generate(PROMPTS[:2], PARAMS, seeds=[10, 20])
    b = e.generate(PROMPTS[:2], PARAMS, seeds=[10, 20])
    seeds = [sp["sampling_seed"] for sp in generates(fake)[0]["sampling_params"]]
    assert len(set(seeds)) == 8  # every sample its own seed
    assert [c.tokens.tolist() for g in a for c in g] == [c.tokens.tolist() for g in b for c in g]
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        e.generate(PROMPTS[:2], PARAMS, seeds=[1])


def test_seed_per_prompt_needs_deterministic_servers(fakes):
    (fake,) = fakes(deterministic=False)
    with pytest.raises(SGLangError, match="--enable-deterministic-inference"):
        engine(fake.url, **{"rollout.seed_per_prompt": "true"})


def test_groups_are_balanced_across_servers_and_never_split(fakes, store):
    a, b = fakes(2)
    e = loaded(store, a.url, b.url)
    prompts = [[11, i, 12] for i in range(6)]
    groups = e.generate(prompts, PARAMS)
    rows = {f.url: generates(f)[0]["input_ids"] for f in (a, b)}
    assert sorted(len(r) for r in rows.values()) == [12, 12]
    for r in rows.values():  # whole groups, sent sample-major: 3 prompts a server, each 4 times
        assert all(r[i:i + 3] == r[:3] for i in range(0, len(r), 3)) and len({tuple(p) for p in r}) == 3
    assert [g[0].tokens.tolist()[0] for g in groups] == [(11 + i + 12) % 10 for i in range(6)]



def test_finish_reason_is_stop_exactly_when_the_last_token_stops(fakes, store, tmp_path):
    """SGLang answers "length" for a stop token sampled as the last allowed token (the fake does as SGLang 0.5.14,
    schedule_batch.py:1412): the engine reports "stop" for it, for the run's EOS and for an EOS of model.path's
    generation_config.json (which SGLang stops on by itself, and which is sent too), and "length" for a sample cut
    on another token."""
    import json

    ends = {0: EOS, 1: 7, 2: 9}  # 7: the model's other EOS; 9: no stop token

    def sampler(rows, sps):
        return [([1, 2, 3, 4, ends[i % 3]], [-0.5] * 5, "stop" if ends[i % 3] != 9 else "length")
                for i in range(len(rows))]

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 7]}))
    (fake,) = fakes(sampler=sampler)
    e = loaded(store, fake.url, **{"model.path": str(tmp_path)})
    assert e.stop_ids == {EOS, 7}
    got = [(c.tokens[-1], c.finish_reason) for g in e.generate(PROMPTS, PARAMS) for c in g]
    # the fake's row i of the sent order is prompt i % 3's (samples first): each prompt's samples end alike
    assert got == [(ends[i // 4], "length" if ends[i // 4] == 9 else "stop") for i in range(12)]
    reasons = [o for _, path, o in fake.calls if path == "/generate"]
    assert reasons and all(sp["stop_token_ids"] == [7, EOS] for sp in reasons[0]["sampling_params"])  # all sent


# --- aborts, version checks, refusals -----------------------------------------------------------------


def test_aborted_samples_are_generated_again_and_never_returned(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url)
    fake.abort_rows = 3
    groups = e.generate(PROMPTS, PARAMS)
    assert all(c.finish_reason == "stop" and len(c.tokens) == 5 for g in groups for c in g)
    first, retry = generates(fake)
    # only the aborted rows: the first three sent, each prompt's first sample
    assert len(first["input_ids"]) == 12 and retry["input_ids"] == PROMPTS
    assert e.aborted == 3


def test_aborts_past_max_retries_raise(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **{"rollout.sglang.max_retries": 2})
    fake.abort_rows = 10_000
    with pytest.raises(RetriesExhausted, match="3 times.*Aborted"):
        e.generate(PROMPTS, PARAMS)
    assert len(generates(fake)) == 3


def test_samples_of_another_weight_version_raise(fakes, store):
    (fake,) = fakes()
    e = engine(fake.url)
    e.load(store(2))
    fake.report_version = "1"
    with pytest.raises(VersionMismatch, match="loaded 2"):
        e.generate(PROMPTS, PARAMS)


def test_a_400_on_generate_raises_without_retry(fakes, store):
    a, b = fakes(2)
    e = loaded(store, a.url, b.url)
    a.generate_status = b.generate_status = 400
    with pytest.raises(RequestRefused, match="HTTP 400.*fake server failure 400"):
        e.generate(PROMPTS, PARAMS)


# --- servers down, slow, failing ------------------------------------------------------------------------


def test_no_server_up_at_start_raises_naming_the_urls(fakes):
    (fake,) = fakes()
    fake.stop()
    with pytest.raises(ServerUnavailable, match=f"{fake.url}.*startup_timeout_s=1"):
        engine(fake.url, **{"rollout.sglang.startup_timeout_s": 1})


def test_an_unhealthy_server_at_start_is_left_out(fakes, store):
    a, b = fakes(2)
    b.healthy = False
    e = loaded(store, a.url, b.url, **{"rollout.sglang.startup_timeout_s": 1})
    e.generate(PROMPTS, PARAMS)
    assert len(generates(a)) == 1 and generates(b) == []
    assert "/update_weights_from_disk" not in b.paths()


def test_a_server_that_dies_loses_its_rows_to_the_others(fakes, store):
    a, b = fakes(2)
    e = loaded(store, a.url, b.url, **{"rollout.sglang.recover_timeout_s": 0.2})  # every server down: raise soon
    b.stop()
    groups = e.generate(PROMPTS, PARAMS)
    assert sum(len(g) for g in groups) == 12
    assert sum(len(body["input_ids"]) for body in generates(a)) == 12
    a.stop()
    with pytest.raises(ServerUnavailable, match="no SGLang server is up on weight version 0"):
        e.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("status", [500, 503])
def test_a_5xx_moves_the_rows_to_another_server(fakes, store, status):
    a, b = fakes(2)
    e = loaded(store, a.url, b.url)
    a.generate_status = status
    groups = e.generate(PROMPTS, PARAMS)
    assert sum(len(g) for g in groups) == 12
    assert sum(len(body["input_ids"]) for body in generates(b)) == 12


def test_a_slow_server_times_out_and_is_marked_down(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **{"rollout.sglang.request_timeout_s": 0.3, "rollout.sglang.recover_timeout_s": 0.2})
    fake.delay_s = 1.5
    with pytest.raises(ServerUnavailable, match="down"):
        e.generate(PROMPTS, PARAMS)


def test_a_server_back_up_serves_again_after_the_next_load(fakes, store):
    a, b = fakes(2)
    e = loaded(store, a.url, b.url, **{"rollout.sglang.health_check_interval_s": 0.01})
    b.healthy, b.generate_status = False, 503
    e.generate(PROMPTS, PARAMS)  # b fails and is marked down; a takes everything
    b.healthy = True
    time.sleep(0.05)  # past health_check_interval_s since generate's last probe of b (a fast run can be inside it)
    e.load(store(1))  # b is probed again, updated, and serves version 1
    assert b.weight_version == "1"
    e.generate([[11, i, 12] for i in range(6)], PARAMS)
    assert generates(b)[-1]["input_ids"]


# --- weight swaps ---------------------------------------------------------------------------------------


def test_load_pauses_updates_and_continues_each_server(fakes, store):
    a, b = fakes(2)
    e = engine(a.url, b.url)
    assert e.version == -1
    wv = store(3)
    seconds = e.load(wv)
    assert e.version == 3 and seconds >= 0
    for f in (a, b):
        swap = [(p, body) for _, p, body in f.calls if p not in ("/health_generate",)][1:]  # after start-up
        # first the fingerprint's baseline, which finds no files at the launch path (so no proof follows)
        assert [p for p, _ in swap] == ["/server_info", "/model_info", "/update_weights_from_tensor",
                                        "/pause_generation", "/update_weights_from_disk", "/continue_generation",
                                        "/model_info"]
        assert swap[3][1] == {"mode": "retract"}
        assert swap[4][1] == {"model_path": str(wv.path), "weight_version": "3", "flush_cache": True}
        assert f.weight_version == "3" and not f.paused


def test_pause_mode_and_load_format_come_from_the_config(fakes, store):
    (fake,) = fakes()
    e = engine(fake.url, **{"rollout.sglang.pause_mode": "abort", "rollout.sglang.load_format": "safetensors"})
    e.load(store(1))
    calls = {p: body for _, p, body in fake.calls}
    assert calls["/pause_generation"] == {"mode": "abort"}
    assert calls["/update_weights_from_disk"]["load_format"] == "safetensors"


def test_in_place_pause_updates_without_flush_then_flushes_once_idle(fakes, store):
    (fake,) = fakes()
    e = engine(fake.url, **{"rollout.sglang.pause_mode": "in_place", "rollout.sglang.flush_timeout_s": 7})
    e.load(store(1))
    paths = fake.paths()
    i = paths.index("/pause_generation")
    assert paths[i:] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation",
                         "/flush_cache?timeout=7.0", "/model_info"]
    update = [body for _, p, body in fake.calls if p == "/update_weights_from_disk"][0]
    assert update["flush_cache"] is False  # SGLang refuses a flush while in-place-paused requests run
    assert e.version == 1


def test_in_place_flush_that_times_out_fails_the_load(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **{"rollout.sglang.pause_mode": "in_place"})
    fake.busy = True
    with pytest.raises(WeightUpdateError, match="Timed out waiting for idle state"):
        e.load(store(1))
    assert e.version == 0


@pytest.mark.parametrize("how, message", [("load", "Failed to get weights iterator"),
                                          ("flush", "cache was not flushed")])
def test_a_refused_update_keeps_the_old_version_and_unpauses(fakes, store, how, message):
    (fake,) = fakes()
    e = loaded(store, fake.url)
    fake.refuse_update = how
    with pytest.raises(WeightUpdateError, match=f"refused weight version 1.*{message}"):
        e.load(store(1))
    assert e.version == 0
    assert fake.paths()[-1] == "/continue_generation" and not fake.paused
    # its weights are unknown: it serves no more until a load works; generate's wait for a server loads the engine's
    # version 0 onto it, which it refuses as well
    with pytest.raises(WeightUpdateError, match=f"refused weight version 0.*{message}"):
        e.generate(PROMPTS, PARAMS)
    fake.refuse_update = ""
    assert len(e.generate(PROMPTS, PARAMS)) == 3 and fake.weight_version == "0"  # version 0 loaded, then generated
    e.load(store(1))
    assert e.version == 1 and len(e.generate(PROMPTS, PARAMS)) == 3


def test_a_server_down_during_a_swap_is_skipped_if_another_took_it(fakes, store):
    a, b = fakes(2)
    e = loaded(store, a.url, b.url, **{"rollout.sglang.recover_timeout_s": 0.2})  # every server down: raise soon
    b.stop()
    e.load(store(1))
    assert e.version == 1
    a.stop()
    with pytest.raises(ServerUnavailable):
        e.load(store(2))
    assert e.version == 1
