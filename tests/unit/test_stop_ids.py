"""`model_stop_ids`: the ids every rollout engine stops on for a model (the tokenizer's EOS and the EOS ids of
model.path's config.json and generation_config.json, or of the config model.arch builds), and `request_stops`."""

from __future__ import annotations

import json

import pytest

from offpolicy.config import ModelConfig
from offpolicy.data.tokenizer import load_tokenizer
from offpolicy.rollout.engines import SamplingParams, model_stop_ids, request_stops, response_tokenizer

TOKENIZER_EOS = 13


def model_dir(tmp_path, config=None, generation=None) -> ModelConfig:
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return ModelConfig(path=str(tmp_path))


@pytest.mark.parametrize(("config", "generation", "expected"), [
    ({"eos_token_id": 7}, None, {7}),  # an int
    ({"eos_token_id": [7, 8]}, None, {7, 8}),  # a list
    (None, {"eos_token_id": 9}, {9}),  # a generation config alone
    ({"eos_token_id": 7}, {"eos_token_id": [200002, 199999, 200012]}, {7, 200002, 199999, 200012}),  # both: a union
    ({"eos_token_id": None}, {"eos_token_id": [9, None, True]}, {9}),  # no id, and none that is not an int
    (None, None, set()),  # no files
    ("{not json", "[1, 2]", set()),  # unreadable, or no object
])
def test_the_models_eos_ids_join_the_tokenizers(tmp_path, config, generation, expected):
    assert model_stop_ids(model_dir(tmp_path, config, generation), TOKENIZER_EOS) == {TOKENIZER_EOS, *expected}


def test_a_path_that_is_no_directory_gives_the_tokenizers_eos_alone(tmp_path):
    assert model_stop_ids(ModelConfig(path=str(tmp_path / "missing")), TOKENIZER_EOS) == {TOKENIZER_EOS}
    assert model_stop_ids(ModelConfig(path="openai/gpt-oss-20b"), TOKENIZER_EOS) == {TOKENIZER_EOS}  # a hub id


@pytest.mark.parametrize(("arch", "expected"), [
    ({"model_type": "llama", "eos_token_id": 13}, {13}),
    ({"model_type": "qwen2", "eos_token_id": [13, 5]}, {13, 5}),
    ({"model_type": "llama"}, {13, 2}),  # llama's default, which the servers' launch checkpoint holds too
    ({"model_type": "qwen2"}, {13}),  # no default
    ({}, {13}),
])
def test_a_model_built_from_its_arch_stops_on_that_configs_eos(arch, expected):
    assert model_stop_ids(ModelConfig(arch=arch), TOKENIZER_EOS) == expected


def test_the_request_adds_its_stop_token_ids_and_checks_its_seeds():
    params = SamplingParams(n=2, stop_token_ids=(3, 13))
    assert request_stops(frozenset({13, 7}), params, [[1], [2]], None) == [3, 7, 13]
    assert request_stops({13}, params, [[1], [2]], [5, 6]) == [3, 13]
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        request_stops({13}, params, [[1], [2]], [5])


def hf_tokenizer_dir(path):
    """A word-level HF tokenizer whose EOS is `<eos>` (id 1), plus GPT-OSS-like `<|return|>` (id 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<|return|>": 2, "yes": 3, "no": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<pad>").save_pretrained(path)
    return path


def test_the_response_tokenizer_decodes_up_to_the_first_id_an_engine_stops_on(tmp_path):
    """GPT-OSS's generation_config lists <|return|> beside the tokenizer's EOS: a response the engine ended on it
    decodes without it (its text would otherwise reach the reward)."""
    model = model_dir(tmp_path, {"eos_token_id": 1}, {"eos_token_id": [2, 1]})
    hf_tokenizer_dir(tmp_path)
    model = ModelConfig(path=model.path, tokenizer=str(tmp_path))
    tok = response_tokenizer(model)
    assert tok.decode([3, 4, 2]) == "yes no"
    assert tok.decode([3, 1, 4]) == "yes"
    assert load_tokenizer(str(tmp_path)).decode([3, 4, 2]) == "yes no <|return|>"  # what reached rewards before
