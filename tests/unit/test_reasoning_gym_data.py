"""data.source=reasoning_gym: prompts of a named task (seed, size, the task's config), scored by the
task's own scorer through the `reasoning_gym` reward."""

from __future__ import annotations

import json

import pytest

from offpolicy.config import ConfigError, load_config
from offpolicy.data.datasets import load_dataset
from offpolicy.data.rewards import get_reward

reasoning_gym = pytest.importorskip("reasoning_gym")

ARCH = "model.arch={model_type: llama}"


def data(*overrides: str):
    return load_config(None, [ARCH, "data.source=reasoning_gym", "rollout.reward=reasoning_gym", *overrides]).data


def test_prompts_are_the_task_entries_and_the_scorer_is_the_tasks():
    ds = load_dataset(data("data.reasoning_gym={task: letter_counting, seed: 3, size: 20, config: {min_words: 2, max_words: 4}}"))
    theirs = reasoning_gym.create_dataset("letter_counting", seed=3, size=20, min_words=2, max_words=4)
    assert len(ds) == 20
    for i in (0, 7, 19):
        p = ds[i]
        assert p.text == theirs[i]["question"] and p.data_source == "reasoning_gym/letter_counting"
        right = theirs[i]["answer"]
        reward = get_reward("reasoning_gym")
        assert reward(p.text, p.answer, right) == 1.0
        assert reward(p.text, p.answer, f"I think <answer>{right}</answer>") == 1.0
        assert reward(p.text, p.answer, "<answer>banana</answer>") == 0.0
        # the task's own partial credit: the answer inside a longer response
        assert reward(p.text, p.answer, f"{right} or so") == theirs.score_answer(f"{right} or so", theirs[i])
    with pytest.raises(IndexError):
        ds[20]


def test_the_final_answer_reward_reads_a_sentence_as_a_math_grader_does():
    """reasoning_gym_final: the <answer> when there is one, else the final answer of the text (the last number,
    "the answer is x", \\boxed{}), scored by the task; reasoning_gym gives such a sentence partial credit only."""
    ds = load_dataset(data("data.reasoning_gym={task: basic_arithmetic, seed: 1, size: 5, config: {min_terms: 2, "
                           "max_terms: 2, min_digits: 1, max_digits: 2, allow_parentheses: false}}"))
    theirs = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=5, min_terms=2, max_terms=2, min_digits=1,
                                          max_digits=2, allow_parentheses=False)
    final, strict = get_reward("reasoning_gym_final"), get_reward("reasoning_gym")
    for i in range(5):
        p, right = ds[i], theirs[i]["answer"]
        sentence = f"{theirs[i]['question'].split('Calculate ')[-1].rstrip('.')} = {right}"
        assert final(p.text, p.answer, sentence) == 1.0 and 0 < strict(p.text, p.answer, sentence) < 1
        assert final(p.text, p.answer, f"The answer is {right}.") == 1.0
        assert final(p.text, p.answer, f"It is {right}, no, {int(right) + 1}") == 0.0  # the last number counts
        assert final(p.text, p.answer, f"{int(right) + 1} <answer>{right}</answer>") == 1.0  # the tags win
        assert final(p.text, p.answer, "no idea") == 0.0
    load_config(None, [ARCH, "data.source=reasoning_gym", "data.reasoning_gym.task=gcd",
                       "rollout.reward=reasoning_gym_final"])  # accepted beside the task's data


def test_the_same_seed_gives_the_same_prompts():
    a = load_dataset(data("data.reasoning_gym={task: basic_arithmetic, seed: 1, size: 5}"))
    b = load_dataset(data("data.reasoning_gym={task: basic_arithmetic, seed: 1, size: 5}"))
    assert [a[i].text for i in range(5)] == [b[i].text for i in range(5)]
    assert json.loads(a[4].answer)["index"] == 4


def test_an_unknown_task_or_config_field_is_named():
    with pytest.raises(ValueError, match="'letter_countin' is not a reasoning-gym task"):
        load_dataset(data("data.reasoning_gym.task=letter_countin"))
    with pytest.raises(ValueError, match="does not fit task 'letter_counting'"):
        load_dataset(data("data.reasoning_gym={task: letter_counting, config: {colour: red}}"))


def test_the_config_asks_for_the_tasks_scorer_and_a_task():
    with pytest.raises(ConfigError, match="rollout.reward: is 'digits_partial' but data.source is reasoning_gym"):
        load_config(None, [ARCH, "data.source=reasoning_gym", "data.reasoning_gym.task=gcd"])
    with pytest.raises(ConfigError, match="data.reasoning_gym.task"):
        load_config(None, [ARCH, "data.source=reasoning_gym", "rollout.reward=reasoning_gym"])
    wrapped = load_config(None, [ARCH, "data.source=reasoning_gym", "data.reasoning_gym.task=gcd",
                                 "rollout.reward=tests.recording_reward:recording"])  # a function may wrap the scorer
    assert wrapped.rollout.reward == "tests.recording_reward:recording"


def test_the_reward_refuses_answers_of_other_sources():
    with pytest.raises(ValueError, match="needs prompts of data.source=reasoning_gym"):
        get_reward("reasoning_gym")("q", "42", "42")
