"""The math reward on a table of tricky answers: extraction (\\boxed with nested braces, GSM8K ####,
"the answer is"), numeric equivalence and symbolic equivalence through math-verify."""

from __future__ import annotations

import threading

import pytest

from offpolicy.data.math_answers import extract_answer, last_boxed, reference_answer, score, to_number
from offpolicy.data.rewards import get_reward

# (reference, response, reward)
TABLE = [
    ("72", "Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72", 1.0),  # GSM8K style
    ("72", "#### 72.", 1.0),
    ("72", "so the total is 70 + 2.\n#### 73", 0.0),
    ("1000", "The answer is 1,000.", 1.0),  # thousands separator
    ("1,000", "\\boxed{1000}", 1.0),
    ("18", "She makes $\\boxed{\\$18}$ every day.", 1.0),  # currency inside the box
    ("18", "\\boxed{18.00}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),  # fraction = decimal
    ("\\frac{3}{4}", "Thus x = \\boxed{\\dfrac{3}{4}}.", 1.0),  # \dfrac
    ("3/4", "\\boxed{0.75}", 1.0),
    ("\\frac12", "\\boxed{1/2}", 1.0),
    ("-5", "\\boxed{-5}", 1.0),
    ("-5", "\\boxed{5}", 0.0),  # sign matters
    ("50", "\\boxed{50\\%}", 1.0),  # percentages as GSM8K writes them
    ("10", "\\boxed{10 \\text{ cm}}", 1.0),  # a unit in \text
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),  # symbolic (math-verify)
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("(x+1)^2", "\\boxed{x^2+2x}", 0.0),
    ("\\pi", "\\boxed{\\pi}", 1.0),
    ("2\\pi", "\\boxed{\\pi}", 0.0),
    ("(0, 1]", "\\boxed{(0,1]}", 1.0),  # interval
    ("\\{1, 2, 3\\}", "\\boxed{\\{3,2,1\\}}", 1.0),  # set order
    ("3", "First \\boxed{2}, on second thought \\boxed{3}", 1.0),  # the last box counts
    ("2", "First \\boxed{2}, on second thought \\boxed{3}", 0.0),
    ("3", "\\boxed 3", 1.0),  # \boxed without braces
    ("3", "I am not sure.", 0.0),  # no answer at all
    ("3", "\\boxed{}", 0.0),  # an empty box
    ("7", "5 + 2 = 7", 1.0),  # no marker: the last number
    ("\\boxed{42}", "It is \\boxed{42}", 1.0),  # a reference given as a worked solution
    ("The sum is 6.\n#### 6", "#### 6", 1.0),
]


@pytest.mark.parametrize("reference, response, reward", TABLE)
def test_math_reward_table(reference, response, reward):
    assert get_reward("math")("", reference, response) == reward


def test_extraction():
    assert last_boxed("a \\boxed{\\frac{\\sqrt{2}}{2}} b") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("\\fbox{4} and \\boxed{5") == "4"  # the unbalanced last box is skipped
    assert last_boxed("no box") is None
    assert extract_answer("Therefore, the final answer is: 12.") == "12"
    assert extract_answer("####  1,234\n") == "1,234"
    assert extract_answer("nothing numeric") is None
    assert reference_answer("Worked: 3 + 4 = 7\n#### 7") == "7" and reference_answer(" 7 ") == "7"


def test_numbers():
    from fractions import Fraction

    assert to_number("\\frac{3}{4}") == Fraction(3, 4) and to_number("-\\frac{1}{2}") == Fraction(-1, 2)
    assert to_number("1,234,567.5") == Fraction(2469135, 2) and to_number("1e3") == 1000
    assert to_number("12,34") is None and to_number("x+1") is None and to_number("1/0") is None


def test_math_reward_off_the_main_thread():
    """math-verify's SIGALRM bound works only on the main thread: elsewhere it runs unbounded, not failing."""
    out = []
    t = threading.Thread(target=lambda: out.append(score("x^2+2x+1", "\\boxed{(x+1)^2}")))
    t.start()
    t.join()
    assert out == [1.0]
