"""Tests for offpolicy/config/checks.py: `validate`'s cross-field checks name the field and carry a fix, boundary
values pass, the shipped configs validate, and the Megatron layout, eval, data and low-bit format options are
checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from offpolicy.config import AlgoConfig, Config, ConfigError, ModelConfig, load_config
from offpolicy.config.checks import validate
from tests.config_files import QUICKSTART, load


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


@pytest.mark.parametrize("name", sorted(p.name for p in
                                         (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")))
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
    assert (e.every_versions, e.k, e.n_samples, e.data.source, e.data.synthetic.task) == (5, [1, 4], 4, "x.jsonl.gz",
                                                                                           "copy")
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
    assert (d.overlong_prompts, d.format, d.chat_template_kwargs) == ("truncate_left", "gsm8k",
                                                                       {"reasoning_effort": "medium"})
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
