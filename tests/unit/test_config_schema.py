"""Tests for offpolicy/config/schema.py: the built-in defaults, `to_yaml` (round trips, plain YAML) and
`learner_host`."""

from __future__ import annotations

import pytest
import yaml

from offpolicy.config import Config, ConfigError, ModelConfig, learner_host, load_config, to_yaml
from offpolicy.config.checks import validate
from tests.config_files import QUICKSTART, load, write


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
