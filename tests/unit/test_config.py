"""Tests for offpolicy.config: YAML loading, dotted overrides, errors that name the field, validation,
the --dry-run/--help behaviour of the daemons' entry points, and that none of it imports torch."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from offpolicy.config import (
    AlgoConfig,
    Config,
    ConfigError,
    ModelConfig,
    apply_override,
    learner_host,
    load_config,
    to_yaml,
)
from offpolicy.config.checks import validate

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"

# The built-in defaults name no model; this is the smallest addition that makes them valid.
ARCH = ["model.arch.model_type=llama"]


def load(*overrides: str) -> Config:
    return load_config(None, [*ARCH, *overrides])


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults --------------------------------------------------------------------------------------


def test_defaults_have_the_documented_values():
    cfg = Config()
    assert cfg.run.name == "offpolicy"
    assert cfg.model.path is None and cfg.model.arch == {}
    assert cfg.model.dtype == "float32"
    assert cfg.data.source == "synthetic" and cfg.data.synthetic.task == "reverse"
    assert cfg.rollout.n_samples == 8 and cfg.rollout.top_p == 1.0 and cfg.rollout.stop_token_ids == []
    assert cfg.learner.betas == (0.9, 0.999)
    assert cfg.algo.max_staleness == 1
    assert (cfg.transport.work_port, cfg.transport.announce_port) == (5555, 5556)
    assert cfg.weights.keep == 3 and cfg.weights.checksum == "auto" and cfg.weights.reuse_files == "auto"
    assert cfg.metrics.port == 0


def test_defaults_do_not_share_mutable_fields():
    a, b = Config(), Config()
    a.model.arch["hidden_size"] = 8
    a.rollout.stop_token_ids.append(3)
    assert b.model.arch == {} and b.rollout.stop_token_ids == []


def test_defaults_without_a_model_are_refused_naming_model_arch():
    with pytest.raises(ConfigError, match=r"model\.arch") as e:
        load_config(None)
    assert "model.path" in str(e.value)  # the fix names both ways to give a model


@pytest.mark.parametrize("override, model", [
    ("model.path=/models/tiny", ModelConfig(path="/models/tiny")),
    ("model.arch.model_type=llama", ModelConfig(arch={"model_type": "llama"})),
])
def test_defaults_load_once_a_model_is_named(override, model):
    assert load_config(None, [override]) == Config(model=model)


def test_default_config_with_a_model_passes_validate():
    assert validate(Config(model=ModelConfig(arch={"model_type": "llama"}))) is None


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


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
                      "publish_gap_mib", "overlap_publish", "formats", "native", "fp8_block_size", "fp8_skip", "keep_after_run"]


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


# --- cross-field checks in validate() --------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    (["run.name=a/b"], "run.name"),
    (["run.name=../up"], "run.name"),
    (["run.name=has space"], "run.name"),
    (["run.name="], "run.name"),
    (["run.rollouts=0"], "run.rollouts"),
    (["run.log_level=info"], "run.log_level"),
    (["data.source=prompts.csv"], "data.source"),
    (["data.synthetic.length=0"], "data.synthetic.length"),
    (["data.synthetic.num_prompts=0"], "data.synthetic.num_prompts"),
    (["rollout.n_samples=1"], "rollout.n_samples"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.top_p=1.01"], "rollout.top_p"),
    (["rollout.top_k=-1"], "rollout.top_k"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens"),
    (["rollout.groups_per_lease=0"], "rollout.groups_per_lease"),
    (["rollout.prefetch_leases=-1"], "rollout.prefetch_leases"),
    (["rollout.static_cache=false", "rollout.compile=true"], "rollout.compile"),
    (["learner.batch_groups=0"], "learner.batch_groups"),
    (["learner.micro_batch_groups=0"], "learner.micro_batch_groups"),
    (["learner.total_steps=0"], "learner.total_steps"),
    (["learner.lr=0"], "learner.lr"),
    (["learner.lr=-1e-3"], "learner.lr"),
    (["learner.betas=[1,2]"], "learner.betas"),
    (["learner.betas=[0.9,1.0]"], "learner.betas"),
    (["learner.betas=[-0.1,0.9]"], "learner.betas"),
    (["learner.summary_window=0"], "learner.summary_window"),
    (["algo.max_staleness=-1"], "algo.max_staleness"),
    (["algo.clip_ratio_high=-0.1"], "algo.clip_ratio_low/high"),
    (["algo.clip_ratio_low=1"], "algo.clip_ratio_low"),
    (["algo.adv_eps=0"], "algo.adv_eps"),
    (["transport.work_port=0"], "transport.work_port"),
    (["transport.announce_port=65536"], "transport.announce_port"),
    (["transport.announce_port=5555"], "transport.announce_port"),
    (["transport.work_port=7000", "transport.announce_port=7000"], "transport.announce_port"),
    (["transport.hwm=0"], "transport.hwm"),
    (["transport.heartbeat_timeout_s=2"], "transport.heartbeat_timeout_s"),
    (["transport.lease_timeout_s=0"], "transport.lease_timeout_s"),
    (["weights.keep=1"], "weights.keep"),
    (["weights.shard_bytes=1000"], "weights.shard_bytes"),
    (["weights.formats=[fp8,fp8]"], "weights.formats"),
    (["weights.fp8_block_size=[0,128]"], "weights.fp8_block_size"),
    (["rollout.weights_format=fp8"], "rollout.weights_format"),
    (["weights.formats=[fp8]", "rollout.weights_format=mxfp4"], "rollout.weights_format"),
    (["weights.formats=[fp8]", "rollout.weights_format=fp8", "rollout.engine=sglang", "model.path=/m",
      "rollout.sglang.quantization=mxfp4"], "rollout.sglang.quantization"),
    (["weights.formats=[fp8]", "weights.native=checkpoints"], "weights.native"),
    (["weights.formats=[fp8]", "rollout.weights_format=fp8", "weights.native=checkpoints", "eval.every_versions=5"],
     "weights.native"),
    (["weights.formats=[fp8]", "rollout.weights_format=fp8", "weights.native=checkpoints", "relay.formats=[native]"],
     "relay.formats"),
    (["metrics.port=-1"], "metrics.port"),
    (["metrics.port=65536"], "metrics.port"),
    (["metrics.log_every=0"], "metrics.log_every"),
])
def test_cross_field_check_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    assert str(e.value).startswith(f"config field {field}:")


def test_key_value_heads_that_do_not_divide_the_heads_are_refused_naming_the_field():
    """benchmarks/vllm_load.py --hidden 2880 made 45 heads and 22 key-value heads: vLLM died at start on the H200."""
    base = ["model.arch.model_type=llama", "model.arch.hidden_size=2880", "model.arch.num_attention_heads=45"]
    with pytest.raises(ConfigError, match="config field model.arch.num_key_value_heads: is 22, which does not divide"):
        load_config(None, [*base, "model.arch.num_key_value_heads=22"])
    assert load_config(None, [*base, "model.arch.num_key_value_heads=15"]).model.arch["num_key_value_heads"] == 15


@pytest.mark.parametrize("overrides", [[], ["model.arch.hidden_size=32"], ["model.arch={}"]])
def test_missing_model_arch_names_model_arch(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith("config field model.arch:")


@pytest.mark.parametrize("overrides", [
    ["rollout.n_samples=2"],
    ["rollout.top_p=1"],
    ["rollout.top_p=0.01"],
    ["rollout.top_k=0"],
    ["rollout.prefetch_leases=0"],
    ["rollout.compile=true"],  # static_cache auto: compiled wherever the static cache runs
    ["rollout.static_cache=false", "rollout.compile=auto"],
    ["learner.betas=[0,0.999]"],
    ["algo.max_staleness=0"],
    ["algo.clip_ratio_low=0", "algo.clip_ratio_high=0"],
    ["algo.clip_ratio_high=5"],
    ["transport.work_port=1", "transport.announce_port=65535"],
    ["transport.heartbeat_timeout_s=2.5"],
    ["weights.keep=2"],
    ["weights.shard_bytes=1048576"],
    ["metrics.port=0"],
    ["metrics.port=65535"],
    ["run.name=My-Run_2"],
    ["run.log_level=DEBUG"],
    ["data.source=/data/prompts.jsonl"],
    ["data.source=prompts.parquet"],
])
def test_boundary_values_are_accepted(overrides):
    load(*overrides)


def test_validate_on_a_struct_built_directly():
    bad = Config(model=ModelConfig(arch={"model_type": "llama"}), algo=AlgoConfig(max_staleness=-2))
    with pytest.raises(ConfigError, match=r"^config field algo\.max_staleness:"):
        validate(bad)


def test_validation_error_carries_a_fix():
    with pytest.raises(ConfigError) as e:
        load("weights.keep=1")
    problem_and_fix = str(e.value).split(": ", 1)[1]
    assert "; " in problem_and_fix and "keep at least 2" in problem_and_fix


# --- to_yaml ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    [],
    ["learner.betas=[0.8,0.95]", "learner.lr=1e-6", "algo.adv_eps=1e-12"],
    ["rollout.stop_token_ids=[1,2,3]", "model.arch.rope_scaling.factor=2.0", "model.path=/m"],
    ["run.name='007'", "transport.learner_host=10.0.0.1", "data.source=x.jsonl"],
])
def test_to_yaml_round_trips(tmp_path, overrides):
    cfg = load_config(QUICKSTART, overrides)
    text = to_yaml(cfg)
    again = load_config(write(tmp_path, text, "dumped.yaml"))
    assert again == cfg
    assert to_yaml(again) == text


def test_to_yaml_of_defaults_round_trips(tmp_path):
    cfg = load()
    assert load_config(write(tmp_path, to_yaml(cfg))) == cfg


def test_to_yaml_is_plain_yaml_with_every_section_in_order():
    raw = yaml.safe_load(to_yaml(load("algo.max_staleness=0")))
    assert list(raw) == list(Config.__struct_fields__)
    assert raw["algo"]["max_staleness"] == 0
    assert raw["learner"]["betas"] == [0.9, 0.999]


# --- the shipped quickstart config ----------------------------------------------------------------


def test_quickstart_loads_and_validates():
    cfg = load_config(QUICKSTART)
    assert validate(cfg) is None
    assert cfg.run.name == "quickstart"
    assert cfg.model.path is None and cfg.model.arch["model_type"] == "llama"
    assert cfg.model.arch["vocab_size"] == 16
    assert cfg.data.synthetic.task == "copy" and cfg.data.synthetic.length == 4
    assert cfg.rollout.n_samples == 16 and cfg.rollout.device == "cpu"
    assert cfg.learner.device == "cpu" and cfg.learner.total_steps == 300
    assert cfg.algo.max_staleness == 1
    assert cfg.metrics.port == 9400


# --- learner_host -----------------------------------------------------------------------------------


def test_learner_host_from_config_without_env(monkeypatch):
    monkeypatch.delenv("OFFPOLICY_LEARNER_HOST", raising=False)
    assert learner_host(load("transport.learner_host=10.1.2.3")) == "10.1.2.3"


def test_learner_host_env_wins(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_LEARNER_HOST", "node17")
    assert learner_host(load("transport.learner_host=10.1.2.3")) == "node17"


def test_learner_host_empty_env_falls_back_to_config(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_LEARNER_HOST", "")
    assert learner_host(load()) == "127.0.0.1"


# --- entry points: --help, --dry-run, bad overrides; no torch on import ---------------------------

DAEMONS = ["offpolicy.services.learner", "offpolicy.services.rollout"]


def run_module(module: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("module", DAEMONS)
def test_help_is_instant(module):
    proc, seconds = run_module(module, "--help")
    assert proc.returncode == 0, proc.stderr
    assert seconds < 2.0
    assert "--dry-run" in proc.stdout and "--config" in proc.stdout and "overrides" in proc.stdout


@pytest.mark.parametrize("module", DAEMONS)
def test_dry_run_prints_the_resolved_yaml(module):
    proc, _ = run_module(module, "--dry-run", "--config", "configs/quickstart.yaml", "algo.max_staleness=0")
    assert proc.returncode == 0, proc.stderr
    assert "max_staleness: 0" in proc.stdout
    assert proc.stdout == to_yaml(load_config(QUICKSTART, ["algo.max_staleness=0"]))


@pytest.mark.parametrize("module", DAEMONS)
@pytest.mark.parametrize("override, field", [
    ("rollout.n_samples=1", "rollout.n_samples"),
    ("rollout.nsamples=4", "rollout.nsamples"),
    ("model.dtype=fp8", "model.dtype"),
])
def test_bad_override_exits_2_naming_the_field(module, override, field):
    proc, _ = run_module(module, "--dry-run", "--config", "configs/quickstart.yaml", override)
    assert proc.returncode == 2
    assert field in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("module", DAEMONS)
def test_missing_config_file_exits_2(module, tmp_path):
    proc, _ = run_module(module, "--dry-run", "--config", str(tmp_path / "none.yaml"))
    assert proc.returncode == 2
    assert "not found" in proc.stderr


@pytest.mark.parametrize("module", [*DAEMONS, "offpolicy.config"])
def test_import_does_not_load_torch(module):
    code = f"import {module}, sys; print('torch' in sys.modules, 'transformers' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False False"


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(name):
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    if name == "cluster.yaml":
        assert cfg.transport.curve  # on in the cluster configs


def test_megatron_layout_is_validated():
    assert load("learner.backend=megatron", "learner.megatron.tp=2").learner.megatron.tp == 2
    with pytest.raises(ConfigError, match="learner.megatron.cp"):
        load("learner.backend=megatron", "learner.megatron.cp=2")
    with pytest.raises(ConfigError, match="learner.megatron.tp"):
        load("learner.backend=megatron", "learner.megatron.tp=0")
    with pytest.raises(ConfigError, match="set learner.backend=megatron"):
        load("learner.megatron.tp=2")
    assert load("learner.backend=megatron", "learner.megatron.pp_microbatches=2").learner.megatron.pp_microbatches == 2
    with pytest.raises(ConfigError, match="learner.megatron.pp_microbatches.*auto"):
        load("learner.backend=megatron", "learner.megatron.pp_microbatches=0")


# -- the eval section and the data options -----------------------------------------------------------
def test_eval_section_defaults_and_overrides():
    cfg = load("eval.every_versions=5", "eval.k=[1, 4]", "eval.n_samples=4", "eval.data.source=x.jsonl.gz",
               "eval.data.synthetic={task: copy, length: 4}")
    e = cfg.eval
    assert (e.every_versions, e.k, e.n_samples, e.data.source, e.data.synthetic.task) == (5, [1, 4], 4, "x.jsonl.gz", "copy")
    assert load().eval.every_versions == 0 and load().eval.k == [1]


@pytest.mark.parametrize("overrides, field", [
    (["eval.k=[1, 20]", "eval.n_samples=16"], "eval.k"),
    (["eval.k=[]"], "eval.k"),
    (["eval.n_samples=0", "eval.k=[1]"], "eval.n_samples"),
    (["eval.every_versions=-1"], "eval.every_versions"),
    (["eval.data.source=x.csv"], "eval.data.source"),
    (["data.chat_template=true"], "data.chat_template"),
    (["eval.data.chat_template_kwargs={reasoning_effort: low}"], "eval.data.chat_template_kwargs"),
    (["eval.gpus=[1]", "eval.device=cuda:1"], "eval.device"),
    (["data.max_prompt_tokens=0"], "data.max_prompt_tokens"),
])
def test_eval_and_data_checks_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"config field {field}"):
        load(*overrides)


def test_data_options_load():
    cfg = load("data.overlong_prompts=truncate_left", "data.format=gsm8k", "model.tokenizer=/some/dir",
               "data.chat_template=true", "data.chat_template_kwargs={reasoning_effort: medium}")
    d = cfg.data
    assert (d.overlong_prompts, d.format, d.chat_template_kwargs) == ("truncate_left", "gsm8k", {"reasoning_effort": "medium"})
    with pytest.raises(ConfigError, match="data.overlong_prompts"):
        load("data.overlong_prompts=middle")
def test_low_bit_rollout_formats_load():
    c = load("weights.formats=[fp8, mxfp4]", "weights.fp8_block_size=[90, 90]", "rollout.weights_format=mxfp4",
             "rollout.engine=sglang", "model.path=/m", "rollout.sglang.quantization=mxfp4")
    assert c.weights.formats == ["fp8", "mxfp4"] and c.weights.fp8_block_size == (90, 90)
    assert c.rollout.weights_format == "mxfp4"
    with pytest.raises(ConfigError, match="weights.formats"):
        load("weights.formats=[int4]")


def test_prompt_template_needs_its_placeholder():
    assert load("data.prompt_template='{prompt} Answer.'").data.prompt_template == "{prompt} Answer."
    with pytest.raises(ConfigError, match=r"data.prompt_template.*put \{prompt\}"):
        load("data.prompt_template=Answer.")
    with pytest.raises(ConfigError, match="eval.data.prompt_template"):
        load("eval.data.prompt_template=Answer.")


def test_native_versions_at_checkpoints_only_are_a_valid_low_bit_run():
    from offpolicy.learner.checkpoint import exports
    from offpolicy.relay.node import relayed_formats

    cfg = load("weights.formats=[mxfp4]", "rollout.weights_format=mxfp4", "weights.native=checkpoints",
               "checkpoint.every_steps=10", "learner.total_steps=25")
    assert relayed_formats(cfg) == ["mxfp4"]  # nothing waits for native versions that will not come
    assert [v for v in range(30) if exports(cfg, v)] == [10, 20, 25]
    assert relayed_formats(load("weights.formats=[mxfp4]", "rollout.weights_format=mxfp4")) == ["native", "mxfp4"]
    assert [v for v in range(30) if exports(load("checkpoint.final=false", "learner.total_steps=25"), v)] == []
