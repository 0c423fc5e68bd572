"""Reward functions: digits_partial by hand, exact_match, the registry and 'module:function' imports."""

from __future__ import annotations

import pytest

from offpolicy import rewards
from offpolicy.rewards import digits_partial, exact_match, get_reward, register


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
    assert get_reward("offpolicy.rewards:exact_match") is exact_match


@pytest.mark.parametrize("name", ["offpolicy.rewards:no_such_function", "no_such_module_xyz:score"])
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
