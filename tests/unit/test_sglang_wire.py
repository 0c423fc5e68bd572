"""offpolicy.rollout.engines.sglang.wire and .local.engine_kwargs against JSON shapes copied from sglang 0.5.23
(tests/fixtures/sglang/*.json cite the source lines)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.sglang.local import dp_attention_kwargs, engine_kwargs, shared_gpu_warning
from offpolicy.rollout.engines.sglang.wire import (
    SGLangError,
    VersionMismatch,
    abort_message,
    error_message,
    finish_type,
    generate_body,
    parse_output,
    sample_seed,
    sampling_params,
)
from tests.conftest import ROOT
from tests.sglang_fake import SAMPLING_KEYS, fixture

PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=6, stop_token_ids=(5,))
STOPS = {13}


def test_generate_body_is_the_fixture_request():
    want = fixture("generate_request.json")["body"]
    sps = [sampling_params(PARAMS, [13, 5], sample_seed(42, i)) for i in range(2)]
    body = generate_body([[11, 1, 2, 12]] * 2, sps, ["offpolicy-test-0", "offpolicy-test-1"])
    assert body == want


def test_sampling_params_use_only_keys_sglang_accepts():
    sp = sampling_params(PARAMS, [13], seed=7)
    assert set(sp) <= SAMPLING_KEYS
    assert sp["n"] == 1 and sp["no_stop_trim"] is True and sp["sampling_seed"] == 7


@pytest.mark.parametrize("ours, theirs", [(0, -1), (1, 1), (50, 50)])
def test_top_k_zero_is_sglangs_minus_one(ours, theirs):
    p = SamplingParams(n=1, top_k=ours)
    assert sampling_params(p, [13])["top_k"] == theirs


def test_no_seed_sends_no_sampling_seed():
    assert "sampling_seed" not in sampling_params(PARAMS, [13])


def test_stop_token_ids_are_sorted_and_unique_as_given():
    assert sampling_params(PARAMS, [13, 5, 2])["stop_token_ids"] == [2, 5, 13]


def test_sample_seeds_differ_per_sample_and_fit_a_signed_int64():
    seeds = {sample_seed(s, i) for s in (0, 1, (1 << 62) - 1) for i in range(16)}
    assert len(seeds) == 48
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_generate_body_needs_one_sampling_params_and_rid_per_row():
    with pytest.raises(ValueError, match="equal"):
        generate_body([[1], [2]], [{}], ["a", "b"])
    with pytest.raises(ValueError):
        generate_body([], [], [])


def test_parse_stop_and_length_outputs():
    stop, length = fixture("generate_response.json")["body"]
    a = parse_output(stop, "3", STOPS)
    assert a.finish_reason == "stop"
    assert a.tokens.dtype == np.int32 and a.tokens.tolist() == [1, 2, 13]  # the stop token stays
    assert a.logprobs.dtype == np.float32
    np.testing.assert_allclose(a.logprobs, [-0.105, -0.223, -0.051], rtol=1e-6)
    assert a.meta["sglang_id"] == "offpolicy-test-0"
    assert (a.meta["prompt_tokens"], a.meta["cached_tokens"]) == (4, 3)  # its prefill, as SGLang reports it
    b = parse_output(length, "3", STOPS)
    assert b.finish_reason == "length" and len(b.tokens) == 6 == len(b.logprobs)


def test_parse_abort_returns_none_and_its_message():
    out = fixture("generate_abort.json")["body"]
    assert finish_type(out) == "abort"
    assert parse_output(out, "3", STOPS) is None
    assert abort_message(out) == "Aborted"


def test_abort_is_reported_even_under_another_version():
    out = fixture("generate_abort.json")["body"]
    assert parse_output(out, "99", STOPS) is None  # dropped and retried, never checked or returned


def test_other_weight_version_raises():
    stop = fixture("generate_response.json")["body"][0]
    with pytest.raises(VersionMismatch, match=r"\['3'\].*loaded 4"):
        parse_output(stop, "4", STOPS)


def test_weight_version_spans_of_two_versions_raise_whichever_is_expected():
    out = fixture("generate_weight_versions.json")["body"]
    for expected in ("3", "4"):
        with pytest.raises(VersionMismatch, match=r"\['3', '4'\]"):
            parse_output(out, expected, STOPS)


def test_no_expected_version_skips_the_check():
    out = fixture("generate_weight_versions.json")["body"]
    assert parse_output(out, None, STOPS).tokens.tolist() == [1, 2, 13]


def _stop():
    return fixture("generate_response.json")["body"][0]


@pytest.mark.parametrize("change, match", [
    (lambda o: o["meta_info"].pop("output_token_logprobs"), "no output_token_logprobs"),
    (lambda o: o["meta_info"].__setitem__("output_token_logprobs", [[0.1]]), "malformed"),
    (lambda o: o.__setitem__("output_ids", [1, 2, 14]), "differ"),
    (lambda o: o["meta_info"].__setitem__("finish_reason", {"type": "eos"}), "unknown reason 'eos'"),
    (lambda o: o["meta_info"].__setitem__("finish_reason", None), "no finish_reason"),
    (lambda o: o.pop("meta_info"), "no meta_info"),
])
def test_malformed_outputs_raise_naming_the_problem(change, match):
    out = _stop()
    change(out)
    with pytest.raises(SGLangError, match=match):
        parse_output(out, "3", STOPS)


def _ending(tokens: list[int], reason: dict) -> dict:
    """An output of sglang 0.5.14 (same shape as the fixture's) with these tokens and finish_reason."""
    out = _stop()
    out["output_ids"] = list(tokens)
    out["meta_info"]["output_token_logprobs"] = [[-0.5, t, None] for t in tokens]
    out["meta_info"]["finish_reason"] = reason
    return out


def test_a_stop_token_sampled_last_is_a_stop_though_sglang_says_length():
    """SGLang checks max_new_tokens before the stop tokens (0.5.14 schedule_batch.py:1412 vs 1436): the GPU run's
    GPT-OSS sample ending in EOS as its 6th token came back {"type": "length", "length": 6}."""
    out = _ending([1, 9, 9, 9, 9, 13], {"type": "length", "length": 6})
    assert parse_output(out, "3", STOPS).finish_reason == "stop"
    assert parse_output(out, "3", {13, 5}).tokens.tolist() == [1, 9, 9, 9, 9, 13]  # the stop token stays
    cut = _ending([1, 9, 9, 9, 9, 9], {"type": "length", "length": 6})
    assert parse_output(cut, "3", STOPS).finish_reason == "length"
    assert parse_output(out, "3", {5}).finish_reason == "length"  # 13 is no stop token of this request


def test_a_stop_on_a_model_eos_not_sent_is_a_stop():
    """SGLang also stops on the EOS ids of the model's config / generation_config (model_config.py:1459-1477)."""
    out = _ending([1, 2, 7], {"type": "stop", "matched": 7})
    assert parse_output(out, "3", STOPS).finish_reason == "stop"


@pytest.mark.parametrize("tokens, reason, match", [
    ([1, 2, 13], {"type": "stop", "matched": "NaN happened"}, "outside the vocabulary"),
    ([1, 2], {"type": "stop", "matched": 13}, "no_stop_trim"),  # the stop token trimmed
    ([1, 2], {"type": "stop"}, "no_stop_trim"),
])
def test_a_stop_that_does_not_end_on_its_stop_token_raises(tokens, reason, match):
    with pytest.raises(SGLangError, match=match):
        parse_output(_ending(tokens, reason), "3", STOPS)


def test_nan_logprob_is_refused():
    out = _stop()
    out["meta_info"]["output_token_logprobs"][1][0] = float("nan")
    with pytest.raises(SGLangError, match="non-finite"):
        parse_output(out, "3", STOPS)


def test_error_message_reads_each_sglang_error_shape():
    import json

    assert error_message(json.dumps(fixture("error_400.json")["body"]).encode()).startswith("The input (70000 tokens)")
    refused = fixture("update_weights_from_disk.json")["refused_load"]
    assert error_message(json.dumps(refused).encode()).startswith("Failed to get weights iterator")
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(fixture("pause_continue.json")["flush_timeout_text"].encode()) == \
        "Timed out waiting for idle state."


# --- in-process engine arguments (no SGLang needed to build them) ---------------------------------------


def test_engine_kwargs_of_the_gptoss_config_use_sglangs_names(monkeypatch):
    """configs/gptoss20b-sglang.yaml runs an engine of one GPU per daemon, the only one whose MXFP4 versions offpolicy's
    loader writes in place (mxfp4_load auto); the seed's TP4 x EP4 would start the engine again on every version."""
    from offpolicy.rollout.engines.sglang import staged

    cfg = load_config(ROOT / "configs" / "gptoss20b-sglang.yaml")
    kw = engine_kwargs(cfg, seed=5)
    assert kw["model_path"] == cfg.model.path and kw["dtype"] == "bfloat16"
    assert (kw["tp_size"], kw["ep_size"], kw["attn_dp_size"], kw["dp_size"]) == (1, 1, 1, 1)
    assert cfg.rollout.weights_format == "mxfp4" and cfg.rollout.sglang.mxfp4_load == "auto"
    monkeypatch.setattr(staged, "engine_device", lambda cfg: torch.device("cuda", 0))  # as on the rollout's GPU
    assert staged.mxfp4_in_place(cfg) and staged.from_tensors(cfg)
    path = ROOT / "configs" / "gptoss20b-sglang.yaml"
    assert not staged.mxfp4_in_place(load_config(path, ["rollout.sglang.tp_size=4", "rollout.sglang.ep_size=4"]))
    load_config(path, ["rollout.sglang.mxfp4_load=inplace"])  # not refused: an engine of one GPU
    assert "quantization" not in kw  # read from the mxfp4 versions' config.json; naming it changes the MoE (docs/sglang.md)
    assert kw["skip_tokenizer_init"] is True
    assert kw["random_seed"] == 5  # rollout.sglang.random_seed unset: the daemon's seed


def test_engine_kwargs_pass_extra_and_leave_unset_options_to_sglang():
    cfg = load_config(None, ["model.path=/m", "rollout.engine=sglang", "rollout.sglang.random_seed=9",
                             "rollout.sglang.extra.max_running_requests=64", "rollout.sglang.extra.base_gpu_id=4"])
    kw = engine_kwargs(cfg, seed=5)
    assert kw["random_seed"] == 9
    assert kw["max_running_requests"] == 64 and kw["base_gpu_id"] == 4
    for unset in ("quantization", "mem_fraction_static", "attention_backend", "load_format"):
        assert unset not in kw


def test_dp_attention_takes_each_sglang_versions_names():
    """0.5.23 has attn_dp_size; 0.5.14 (the GPU machines') turns DP attention on with dp_size as the group count."""
    new, old = {"attn_dp_size", "dp_size"}, {"enable_dp_attention", "dp_size"}
    assert dp_attention_kwargs(2, 1, new) == dp_attention_kwargs(2, 1, None) == {"attn_dp_size": 2, "dp_size": 1}
    assert dp_attention_kwargs(1, 2, old) == {"dp_size": 2}  # replicas, no DP attention
    assert dp_attention_kwargs(4, 1, old) == {"enable_dp_attention": True, "dp_size": 4}
    with pytest.raises(ValueError, match="set dp_size to 1"):
        dp_attention_kwargs(2, 2, old)
    cfg = load_config(ROOT / "configs" / "gptoss20b-sglang.yaml")
    assert "attn_dp_size" not in engine_kwargs(cfg, seed=5, fields=old)


def test_an_engine_on_a_learner_gpu_with_an_unbounded_pool_is_warned_about():
    """On the H200 the in-process engine beside the learner ran with max_total_tokens 65536: without a bound SGLang
    takes the pool from what is free at its start, before the learner grows."""
    base = ["model.path=/m", "rollout.engine=sglang", "run.learner_gpus=[0]"]
    said = shared_gpu_warning(load_config(None, [*base, "run.rollout_gpus=[0]"]))
    assert said is not None and "shares GPU 0 with the learner" in said and "rollout.sglang.extra.max_total_tokens" in said
    assert "SGLang's default share" in said
    assert "mem_fraction_static 0.9" in shared_gpu_warning(load_config(None, [*base, "run.rollout_gpus=['1,0']",
                                                                             "rollout.sglang.mem_fraction_static=0.9"]))
    assert shared_gpu_warning(load_config(None, [*base, "run.rollout_gpus=[1]"])) is None  # its own GPU
    assert shared_gpu_warning(load_config(None, [*base, "run.rollout_gpus=[0]",
                                                 "rollout.sglang.extra.max_total_tokens=65536"])) is None
    assert shared_gpu_warning(load_config(None, ["model.path=/m", "rollout.engine=sglang"])) is None  # inherited


def test_a_row_without_whole_prompt_counts_says_no_prefill():
    stop = fixture("generate_response.json")["body"][0]
    for change in ({"cached_tokens": None}, {"cached_tokens": 5}, {"prompt_tokens": "4"}):
        out = {**stop, "meta_info": {**stop["meta_info"], **change}}
        assert "cached_tokens" not in parse_output(out, "3", STOPS).meta, change
