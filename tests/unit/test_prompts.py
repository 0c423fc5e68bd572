"""Prompt encoding under data options: chat templates with kwargs (a harmony-style template built here),
max_prompt_tokens with error / filter / left and right truncation, and the counts of what was cut."""

from __future__ import annotations

import pytest

from offpolicy.config import DataConfig, SyntheticConfig
from offpolicy.data.encoding import PromptEncoder, filter_overlong, load_prompts
from offpolicy.data.tokenizer import DigitTokenizer, load_tokenizer
from tests.hf_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return load_tokenizer(str(build_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_plain_prompts_are_the_tokenizers_encoding():
    enc = PromptEncoder(DigitTokenizer(), DataConfig())
    assert enc.encode("123=") == DigitTokenizer().encode("123=")


@pytest.mark.parametrize("mode, expected", [("truncate_left", [3, 4, 5, 6, 12]), ("truncate_right", [11, 1, 2, 3, 4])])
def test_truncation_keeps_the_last_or_first_tokens_and_counts(mode, expected):
    enc = PromptEncoder(DigitTokenizer(), DataConfig(max_prompt_tokens=5, overlong_prompts=mode))
    assert enc.encode("123456=") == expected  # [BOS 1 2 3 4 5 6 =] cut to 5
    assert enc.encode("12=") == [11, 1, 2, 12] and enc.counts.truncated == 1


def test_an_overlong_prompt_is_refused_naming_the_field_and_the_fixes():
    enc = PromptEncoder(DigitTokenizer(), DataConfig(max_prompt_tokens=3), section="eval.data")
    with pytest.raises(ValueError, match=r"prompt 7 has 5 tokens, over eval.data.max_prompt_tokens=3.*truncate_left"):
        enc.encode("123=", prompt_id=7)


def test_filter_drops_overlong_prompts_renumbers_and_counts():
    # synthetic prompts of 3 digits are 5 tokens (BOS, 3 digits, '='); a limit of 4 filters all, 5 none
    cfg = DataConfig(synthetic=SyntheticConfig(length=3, num_prompts=6), max_prompt_tokens=5, overlong_prompts="filter")
    ds, enc = load_prompts(cfg, DigitTokenizer())
    assert len(ds) == 6 and enc.counts.as_dict() == {"read": 6, "dropped_bad_rows": 0, "filtered_overlong": 0, "truncated": 0, "kept": 6}
    with pytest.raises(ValueError, match="every one of the 6 prompts"):
        load_prompts(DataConfig(synthetic=SyntheticConfig(length=3, num_prompts=6), max_prompt_tokens=4,
                                overlong_prompts="filter"), DigitTokenizer())


def test_filter_keeps_exactly_the_prompts_that_fit(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "{"1" * n}=", "answer": "{n}"}}\n' for n in (1, 6, 2, 9, 3)))
    enc = PromptEncoder(DigitTokenizer(), DataConfig(source=str(path), max_prompt_tokens=5, overlong_prompts="filter"))
    from offpolicy.data.datasets import load_dataset

    ds = filter_overlong(load_dataset(enc.cfg), enc)
    assert [ds[i].answer for i in range(len(ds))] == ["1", "2", "3"] and [ds[i].id for i in range(3)] == [0, 1, 2]
    assert enc.counts.as_dict() == {"read": 5, "dropped_bad_rows": 0, "filtered_overlong": 2, "truncated": 0, "kept": 3}


def test_chat_template_with_reasoning_effort_and_system_prompt(harmony):
    cfg = DataConfig(chat_template=True, chat_template_kwargs={"reasoning_effort": "high"}, system_prompt="Be brief.")
    ids = PromptEncoder(harmony, cfg).encode("What is 2 + 2?")
    text = harmony._tok.decode(ids)
    assert text == ("<|start|>system<|message|>You are a helpful assistant.\nReasoning: high\n\n# Valid channels: "
                    "analysis, commentary, final.<|end|><|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
                    "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    start = harmony._tok.convert_tokens_to_ids("<|start|>")
    assert ids[0] == start and ids.count(start) == 4  # special tokens are one id each, not spelled out
    default = harmony._tok.decode(PromptEncoder(harmony, DataConfig(chat_template=True)).encode("hi"))
    assert "Reasoning: medium" in default and "developer" not in default


def test_truncation_applies_to_the_templated_ids(harmony):
    full = PromptEncoder(harmony, DataConfig(chat_template=True)).encode("x" * 50)
    cut = PromptEncoder(harmony, DataConfig(chat_template=True, max_prompt_tokens=20, overlong_prompts="truncate_left"))
    assert cut.encode("x" * 50) == full[-20:]


def test_chat_template_needs_a_tokenizer_that_has_one(tmp_path):
    with pytest.raises(ValueError, match="chat_template is on but the tokenizer has no chat template"):
        PromptEncoder(DigitTokenizer(), DataConfig(chat_template=True))
    plain = load_tokenizer(str(build_tokenizer(tmp_path, chat_template=None)))
    with pytest.raises(ValueError, match="has no chat_template: set data.chat_template=false"):
        PromptEncoder(plain, DataConfig(chat_template=True)).encode("hi")


def test_prompt_template_puts_the_text_in_place_for_the_model_only(harmony):
    """data.prompt_template wraps the prompt's text (in the user message with the chat template, or alone);
    chat-message rows (verl) keep their messages as they are."""
    from offpolicy.data.prompt import Prompt

    cfg = DataConfig(chat_template=True, prompt_template="Q: {prompt} Answer in <answer></answer>.")
    text = harmony._tok.decode(PromptEncoder(harmony, cfg).encode(Prompt(0, "What is 2 + 2?", "4")))
    assert text.endswith("<|start|>user<|message|>Q: What is 2 + 2? Answer in <answer></answer>.<|end|><|start|>assistant")
    plain = PromptEncoder(harmony, DataConfig(prompt_template="{prompt}!")).encode("hi")
    assert plain == harmony.encode("hi!")
    chat = Prompt(1, "hi", "", messages=(("user", "hello"),))
    assert "Q: " not in harmony._tok.decode(PromptEncoder(harmony, cfg).encode(chat))


def test_hold_out_leaves_every_eval_problem_out_of_training_and_renumbers():
    """eval.hold_out on reasoning-gym's 1-2 digit arithmetic: two seeds share most small problems; what is left
    to train on shares none with the eval set, keeps every other draw in order, and is renumbered from 0."""
    pytest.importorskip("reasoning_gym")
    from offpolicy.config import ReasoningGymConfig
    from offpolicy.data.encoding import hold_out
    from offpolicy.data.reasoning_gym_data import ReasoningGymTask

    task = dict(task="basic_arithmetic", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                                 "operators": ["+", "-"], "allow_parentheses": False,
                                                 "allow_negation": False})
    train = ReasoningGymTask(ReasoningGymConfig(seed=0, size=2000, **task))
    held = ReasoningGymTask(ReasoningGymConfig(seed=1000, size=200, **task))
    kept, n = hold_out(train, held)
    eval_texts = {held[i].text for i in range(len(held))}
    rest = [train[i] for i in range(len(train)) if train[i].text not in eval_texts]
    assert n > 0 and len(kept) == len(rest) == len(train) - n
    assert [kept[i].text for i in range(len(kept))] == [p.text for p in rest]
    assert [kept[i].id for i in range(len(kept))] == list(range(len(kept)))
    assert kept[0].answer == rest[0].answer  # the reward's key still names the original draw


def test_hold_out_with_nothing_left_names_the_fix():
    from offpolicy.data.datasets import load_dataset
    from offpolicy.data.encoding import hold_out

    data = load_dataset(DataConfig(synthetic=SyntheticConfig(num_prompts=16)))
    with pytest.raises(ValueError, match="eval.hold_out=false"):
        hold_out(data, data)
