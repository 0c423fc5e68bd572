"""Tests for offpolicy/config/load.py: YAML files, dotted overrides, and the errors that name the field (unknown
fields with the valid ones listed, enum values with the allowed ones, type errors)."""

from __future__ import annotations

import pytest

from offpolicy.config import ConfigError, apply_override, load_config
from tests.config_files import ARCH, QUICKSTART, load, write


# --- YAML files ------------------------------------------------------------------------------------


def test_yaml_file_values_are_loaded_and_the_rest_default(tmp_path):
    path = write(tmp_path, """
run: {name: my-run_1}
model:
  arch: {model_type: llama, hidden_size: 32}
rollout:
  n_samples: 4
  stop_token_ids: [7, 9]
learner:
  betas: [0.8, 0.95]
  lr: 0.01
algo: {max_staleness: 0}
""")
    cfg = load_config(path)
    assert cfg.run.name == "my-run_1"
    assert cfg.model.arch == {"model_type": "llama", "hidden_size": 32}
    assert cfg.rollout.n_samples == 4 and cfg.rollout.stop_token_ids == [7, 9]
    assert cfg.learner.betas == (0.8, 0.95) and cfg.learner.lr == 0.01
    assert cfg.algo.max_staleness == 0
    assert cfg.rollout.max_new_tokens == 16 and cfg.transport.work_port == 5555  # untouched defaults


def test_yaml_file_accepts_a_str_path_and_a_path_object(tmp_path):
    path = write(tmp_path, "model: {path: /m}\n")
    assert load_config(str(path)) == load_config(path)


def test_empty_yaml_file_means_defaults(tmp_path):
    path = write(tmp_path, "")
    assert load_config(path, ARCH) == load()


def test_yaml_scientific_float_in_a_typed_field_is_a_float(tmp_path):
    path = write(tmp_path, "model: {path: /m}\nlearner: {lr: 1e-6}\n")
    lr = load_config(path).learner.lr
    assert isinstance(lr, float) and lr == 1e-6


def test_missing_file_raises_config_error_naming_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as e:
        load_config(missing)
    assert str(missing) in str(e.value)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("42\n", "int"), ("just a string\n", "str")])
def test_non_mapping_yaml_is_refused(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="must hold a mapping") as e:
        load_config(path)
    assert kind in str(e.value) and str(path) in str(e.value)


def test_invalid_yaml_is_refused(tmp_path):
    path = write(tmp_path, "rollout: [\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_section_that_is_not_a_mapping_is_refused(tmp_path):
    path = write(tmp_path, "model: {path: /m}\nrollout: 5\n")
    with pytest.raises(ConfigError, match=r"config field rollout\b"):
        load_config(path)


def test_override_into_a_yaml_section_that_is_not_a_mapping_is_refused(tmp_path):
    path = write(tmp_path, "model: {path: /m}\nrollout: 5\n")
    with pytest.raises(ConfigError, match="rollout is not a section"):
        load_config(path, ["rollout.n_samples=4"])


# --- dotted overrides -------------------------------------------------------------------------------


def test_override_int_zero():
    cfg = load("algo.max_staleness=0")
    assert cfg.algo.max_staleness == 0 and type(cfg.algo.max_staleness) is int


def test_override_list_into_a_tuple_field():
    assert load("learner.betas=[0.8,0.9]").learner.betas == (0.8, 0.9)


def test_override_into_the_free_form_arch_dict():
    cfg = load("model.arch.hidden_size=32", "model.arch.tie_word_embeddings=false")
    assert cfg.model.arch == {"model_type": "llama", "hidden_size": 32, "tie_word_embeddings": False}
    assert type(cfg.model.arch["hidden_size"]) is int


def test_override_nested_mapping_inside_arch():
    cfg = load("model.arch.rope_scaling.factor=2.0", "model.arch.rope_scaling.rope_type=linear")
    assert cfg.model.arch["rope_scaling"] == {"factor": 2.0, "rope_type": "linear"}


@pytest.mark.parametrize("override, get, value", [
    ("rollout.stop_token_ids=[1, 2]", lambda c: c.rollout.stop_token_ids, [1, 2]),
    ("rollout.stop_token_ids=[]", lambda c: c.rollout.stop_token_ids, []),
    ("data.shuffle=false", lambda c: c.data.shuffle, False),
    ("data.synthetic.task=sort", lambda c: c.data.synthetic.task, "sort"),
    ("rollout.temperature=0.7", lambda c: c.rollout.temperature, 0.7),
    ("rollout.temperature=2", lambda c: c.rollout.temperature, 2.0),
    ("learner.lr=1e-6", lambda c: c.learner.lr, 1e-6),
    ("model.path=/models/qwen", lambda c: c.model.path, "/models/qwen"),
    ("model.path=null", lambda c: c.model.path, None),
    ("run.dir=a=b", lambda c: c.run.dir, "a=b"),  # only the first '=' splits
    (" algo.max_staleness =3", lambda c: c.algo.max_staleness, 3),
    ("transport.learner_host=10.0.0.1", lambda c: c.transport.learner_host, "10.0.0.1"),
])
def test_override_values_parse_as_yaml(override, get, value):
    got = get(load(override))
    assert got == value and type(got) is type(value)


def test_overrides_apply_after_the_file_and_last_one_wins():
    cfg = load_config(QUICKSTART, ["rollout.n_samples=4", "learner.lr=0.5", "learner.lr=0.25"])
    assert cfg.rollout.n_samples == 4
    assert cfg.learner.lr == 0.25
    assert cfg.rollout.max_new_tokens == 6  # from the file, untouched
    assert cfg.model.arch["hidden_size"] == 64


def test_override_of_one_arch_key_keeps_the_rest_of_the_file():
    cfg = load_config(QUICKSTART, ["model.arch.hidden_size=32"])
    assert cfg.model.arch["hidden_size"] == 32 and cfg.model.arch["vocab_size"] == 16


def test_apply_override_edits_the_raw_mapping_in_place():
    raw = {"rollout": {"n_samples": 4}}
    apply_override(raw, "rollout.top_k=5")
    apply_override(raw, "algo.max_staleness=0")
    apply_override(raw, "run.name=")
    assert raw == {"rollout": {"n_samples": 4, "top_k": 5}, "algo": {"max_staleness": 0}, "run": {"name": ""}}


@pytest.mark.parametrize("item", ["algo.max_staleness", "=3", "", "noequals"])
def test_malformed_override_is_refused_with_the_expected_shape(item):
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        apply_override({}, item)


def test_override_value_that_is_not_yaml_is_refused():
    with pytest.raises(ConfigError, match="not a YAML scalar or list") as e:
        load("rollout.stop_token_ids=[1,")
    assert "rollout.stop_token_ids" in str(e.value)


@pytest.mark.parametrize("source", ["override", "file"])
def test_scientific_float_in_arch_is_a_float(tmp_path, source):
    if source == "override":
        cfg = load("model.arch.rms_norm_eps=1e-6")
    else:
        cfg = load_config(write(tmp_path, "model: {arch: {model_type: llama, rms_norm_eps: 1e-6}}\n"))
    eps = cfg.model.arch["rms_norm_eps"]
    assert isinstance(eps, float) and eps == 1e-6


# --- unknown fields and type errors ---------------------------------------------------------------


@pytest.mark.parametrize("override, field, valid", [
    ("rollout.nsamples=4", "rollout.nsamples", ["n_samples", "max_new_tokens", "top_p", "seed"]),
    ("algo.staleness=0", "algo.staleness", ["max_staleness", "clip_ratio_low", "loss_agg"]),
    ("data.synthetic.tsk=copy", "data.synthetic.tsk", ["task", "length", "num_prompts"]),
    ("rollut.n_samples=4", "rollut", ["run", "model", "data", "rollout", "learner", "algo", "transport",
                                      "weights", "metrics"]),
])
def test_unknown_override_field_names_it_and_lists_the_valid_ones(override, field, valid):
    with pytest.raises(ConfigError) as e:
        load(override)
    msg = str(e.value)
    assert f"unknown field {field}" in msg
    listed = msg.split(" has ", 1)[1].split(", ")
    assert set(valid) <= set(listed)


def test_unknown_override_field_lists_exactly_the_section_fields():
    with pytest.raises(ConfigError) as e:
        load("weights.kep=2")
    listed = str(e.value).split(" has ", 1)[1].split(", ")
    assert listed == ["root", "keep", "shard_bytes", "checksum", "verify", "reuse_files", "register_maps",
                      "publish_gap_mib", "overlap_publish", "formats", "native", "fp8_block_size", "fp8_skip",
                      "keep_after_run"]


def test_unknown_field_in_a_yaml_section_names_the_field_and_section(tmp_path):
    path = write(tmp_path, "model: {path: /m}\nrollout: {n_sample: 4}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "n_sample" in str(e.value) and "rollout" in str(e.value)


def test_unknown_field_in_a_yaml_section_lists_the_valid_ones(tmp_path):
    path = write(tmp_path, "model: {path: /m}\nrollout: {n_sample: 4}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "n_samples" in msg and "max_new_tokens" in msg


def test_unknown_top_level_section_in_a_yaml_file_gives_a_clean_message(tmp_path):
    path = write(tmp_path, "model: {path: /m}\nrollut: {n_samples: 4}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith("unknown field rollut:")
    assert "rollout" in msg  # names what the top level has


@pytest.mark.parametrize("override, field, allowed", [
    ("model.dtype=fp8", "model.dtype", ["float32", "bfloat16", "float16", "float64"]),
    ("data.synthetic.task=shuffle", "data.synthetic.task", ["copy", "reverse", "sort"]),
    ("rollout.engine=trtllm", "rollout.engine", ["torch", "sglang", "vllm"]),
    ("learner.backend=deepspeed", "learner.backend", ["torch", "megatron"]),
    ("learner.megatron.recompute=some", "learner.megatron.recompute", ["none", "selective", "full"]),
    ("algo.advantage=ppo", "algo.advantage", ["grpo", "grpo_no_std", "rloo"]),
    ("algo.loss_agg=seq-sum", "algo.loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                                "seq-mean-token-sum-norm"]),
    ("algo.kl_loss_type=k4", "algo.kl_loss_type", ["k1", "k2", "low_var_kl"]),
    ("algo.tis=batch", "algo.tis", ["none", "token", "sequence"]),
    ("weights.checksum=md5", "weights.checksum", ["sha256", "none"]),
])
def test_enum_error_names_the_field_and_lists_the_allowed_values(override, field, allowed):
    with pytest.raises(ConfigError) as e:
        load(override)
    msg = str(e.value)
    assert msg.startswith(f"config field {field}:")
    assert "use one of" in msg
    for value in allowed:
        assert repr(value) in msg


def test_enum_error_from_a_yaml_file_lists_the_allowed_values(tmp_path):
    path = write(tmp_path, "model: {path: /m, dtype: fp64}\n")
    with pytest.raises(ConfigError, match=r"config field model\.dtype:.*'float32', 'bfloat16', 'float16'"):
        load_config(path)


@pytest.mark.parametrize("override, field, expected", [
    ("rollout.n_samples=abc", "rollout.n_samples", "Expected `int`, got `str`"),
    ("rollout.n_samples=8.5", "rollout.n_samples", "Expected `int`, got `float`"),
    ("learner.betas=[0.9]", "learner.betas", "length 2"),
    ("rollout.stop_token_ids=[a]", "rollout.stop_token_ids.0", "Expected `int`"),
    ("run.name=123", "run.name", "Expected `str`"),
    ("rollout.n_samples.x=1", "rollout.n_samples", "Expected `int`"),
])
def test_type_error_names_the_field(override, field, expected):
    with pytest.raises(ConfigError) as e:
        load(override)
    msg = str(e.value)
    assert msg.startswith(f"config field {field}:")
    assert expected in msg
