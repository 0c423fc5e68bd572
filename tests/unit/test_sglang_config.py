"""rollout.sglang: defaults, and validation errors that name the field and the fix."""

from __future__ import annotations

import pytest

from offpolicy.config import Config, ConfigError, SGLangConfig, load_config

HTTP = ["model.arch.model_type=llama", "rollout.engine=sglang", "rollout.sglang.mode=http",
        "rollout.sglang.urls=[http://127.0.0.1:30000]"]
ENGINE = ["model.path=/models/m", "rollout.engine=sglang"]


def test_defaults_are_sglangs_and_nest_under_rollout():
    s = Config().rollout.sglang
    assert s == SGLangConfig()
    assert (s.mode, s.tp_size, s.ep_size, s.attn_dp_size, s.dp_size) == ("engine", 1, 1, 1, 1)
    assert s.skip_tokenizer_init is True and s.pause_mode == "retract" and s.extra == {}


def test_sglang_settings_are_not_checked_while_the_engine_is_torch():
    cfg = load_config(None, ["model.arch.model_type=llama", "rollout.sglang.mode=http"])
    assert cfg.rollout.engine == "torch" and cfg.rollout.sglang.urls == []


def test_valid_http_and_engine_configs_load():
    assert load_config(None, HTTP).rollout.sglang.urls == ["http://127.0.0.1:30000"]
    assert load_config(None, HTTP[:3]).rollout.sglang.urls == []  # `offpolicy run` launches the servers
    cfg = load_config(None, [*ENGINE, "rollout.sglang.tp_size=4", "rollout.sglang.ep_size=2",
                             "rollout.sglang.attn_dp_size=4", "rollout.sglang.quantization=fp8",
                             "rollout.sglang.extra.enable_deterministic_inference=true",
                             "rollout.seed_per_prompt=true"])
    assert cfg.rollout.sglang.extra == {"enable_deterministic_inference": True}


@pytest.mark.parametrize("overrides, field, fix", [
    ([*ENGINE, "rollout.sglang.urls=[http://127.0.0.1:30000]"], "rollout.sglang.urls", "rollout.sglang.mode=http"),
    ([*HTTP[:3], "rollout.sglang.server_port=60000"], "rollout.sglang.server_port", "at most 55534"),
    ([*HTTP[:3], "rollout.sglang.extra.tp_size=2"], "rollout.sglang.extra", "tp_size through rollout.sglang.tp_size"),
    ([*HTTP[:3], "rollout.sglang.urls=[127.0.0.1:30000]"], "rollout.sglang.urls", "http://HOST:PORT"),
    ([*HTTP[:3], "rollout.sglang.urls=[http://h:1/generate]"], "rollout.sglang.urls", "no path"),
    ([*HTTP[:3], "rollout.sglang.urls=[http://h:1, http://h:1/]"], "rollout.sglang.urls", "each server once"),
    (["model.arch.model_type=llama", "rollout.engine=sglang"], "model.path", "HF model directory"),
    ([*ENGINE, "rollout.sglang.tp_size=0"], "rollout.sglang.tp_size", "1 or more"),
    ([*ENGINE, "rollout.sglang.tp_size=4", "rollout.sglang.ep_size=3"], "rollout.sglang.ep_size", "divides tp_size"),
    ([*ENGINE, "rollout.sglang.tp_size=4", "rollout.sglang.attn_dp_size=8"], "rollout.sglang.attn_dp_size",
     "divisor of tp_size"),
    ([*ENGINE, "rollout.sglang.mem_fraction_static=1.5"], "rollout.sglang.mem_fraction_static", "(0, 1)"),
    ([*ENGINE, "rollout.sglang.request_timeout_s=0"], "rollout.sglang.request_timeout_s", "raise it"),
    ([*ENGINE, "rollout.sglang.max_retries=-1"], "rollout.sglang.max_retries", "use 0"),
    ([*ENGINE, "model.dtype=float64"], "model.dtype", "bfloat16"),
    ([*ENGINE, "rollout.sglang.extra.tp_size=2"], "rollout.sglang.extra", "tp_size through rollout.sglang.tp_size"),
    ([*ENGINE, "rollout.sglang.extra.model_path=/x"], "rollout.sglang.extra", "model_path through model.path"),
    ([*ENGINE, "rollout.seed_per_prompt=true"], "rollout.seed_per_prompt", "enable_deterministic_inference=true"),
    ([*HTTP, "weights.formats=[mxfp4]", "rollout.weights_format=mxfp4"], "rollout.sglang.mode",
     "rollout.sglang.mode=engine"),
    ([*HTTP, "rollout.sglang.prefetch=direct"], "rollout.sglang.prefetch", "use rollout.sglang.prefetch=disk, or "
     "rollout.sglang.mode=engine"),
    ([*ENGINE, "rollout.sglang.prefetch=device", "rollout.sglang.dp_size=2"], "rollout.sglang.prefetch", "dp_size 1"),
    ([*ENGINE, "rollout.sglang.prefetch=direct", "rollout.sglang.dp_size=2"], "rollout.sglang.prefetch", "is direct"),
])
def test_invalid_sglang_settings_name_the_field_and_the_fix(overrides, field, fix):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert msg.startswith(f"config field {field}:"), msg
    assert fix in msg


@pytest.mark.parametrize("override, allowed", [
    ("rollout.sglang.mode=grpc", ["engine", "http"]),
    ("rollout.sglang.pause_mode=stop", ["retract", "abort", "in_place"]),
])
def test_sglang_enums_list_their_values(override, allowed):
    with pytest.raises(ConfigError, match="use one of") as e:
        load_config(None, [*ENGINE, override])
    assert all(repr(v) in str(e.value) for v in allowed)


def test_unknown_sglang_field_is_refused_naming_the_section():
    with pytest.raises(ConfigError, match=r"unknown field rollout\.sglang\.tensor_parallel_size: rollout\.sglang has"):
        load_config(None, [*ENGINE, "rollout.sglang.tensor_parallel_size=2"])
