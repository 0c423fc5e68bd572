"""A weight version's config.json spells out what servers on other transformers versions need (SGLang 0.5.14 on
transformers 5.8.1 read GPT-OSS's swiglu_limit and died without it, on an H200)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from offpolicy.weights import WeightStore
from offpolicy.weights.config_json import complete
from offpolicy.weights.formats import config_of


def test_gpt_oss_gets_its_swiglu_limit_and_nothing_else_changes():
    saved = {"model_type": "gpt_oss", "hidden_size": 64}  # as transformers 5.17 saves it: no swiglu_limit
    assert complete(saved) == {"model_type": "gpt_oss", "hidden_size": 64, "swiglu_limit": 7.0,
                               "architectures": ["GptOssForCausalLM"]}
    assert saved == {"model_type": "gpt_oss", "hidden_size": 64}  # the caller's dict is left alone
    assert complete({"model_type": "gpt_oss", "swiglu_limit": 5.0})["swiglu_limit"] == 5.0  # a model's own value stays
    llama = {"model_type": "llama", "hidden_size": 8, "architectures": None}  # as config.to_dict() of a built model
    assert complete(llama) == {**llama, "architectures": ["LlamaForCausalLM"]}
    assert complete({"model_type": "llama", "architectures": ["Mine"]})["architectures"] == ["Mine"]


def test_every_version_config_carries_it(tmp_path):
    """Both writers: a whole version (WeightStore.publish) and a version written in pieces (config_of, the sharded
    and converted versions' config)."""
    store = WeightStore(tmp_path, "run", keep=2)
    pub = store.publish(1, [("w", torch.ones(2, 2))], {"model_type": "gpt_oss"})
    assert json.loads((Path(pub.path) / "config.json").read_text())["swiglu_limit"] == 7.0
    assert config_of("native", {"model_type": "gpt_oss"}, {})["swiglu_limit"] == 7.0
