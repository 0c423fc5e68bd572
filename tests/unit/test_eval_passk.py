"""pass@k against brute-force enumeration of every k-subset, and the summaries over prompts."""

from __future__ import annotations

import itertools
import math

import pytest

from offpolicy.eval.passk import overall, pass_at_k, passed, prompt_summary


def brute_force(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (the first c passing) that hold at least one pass."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_of_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_matches_the_binomial_form_where_it_is_exact_and_stays_finite_past_it():
    for n, c, k in [(20, 3, 5), (50, 1, 10), (100, 37, 50), (200, 1, 100)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one division
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert 0.0 < pass_at_k(2000, 1, 1000) <= 1.0  # C(2000, 1000) is far past a float


def test_edge_cases_and_errors():
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 6, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    with pytest.raises(ValueError, match="eval.n_samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c must lie"):
        pass_at_k(4, 5, 1)


def test_prompt_summary_and_overall_means_over_prompts():
    a = prompt_summary([1.0, 0.0, 0.5, 1.0], [3, 5, 4, 4], ks=[1, 2], threshold=1.0)
    assert a == {"n": 4, "passed": 2, "pass_at_k": {"1": 0.5, "2": pytest.approx(1 - 1 / 6)},
                 "reward_mean": 0.625, "response_tokens_mean": 4.0}
    b = prompt_summary([0.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], ks=[1, 2], threshold=1.0)
    total = overall([a, b], ks=[1, 2])
    assert total["prompts"] == 2 and total["samples"] == 8
    assert total["pass_at_k"] == {"1": 0.25, "2": pytest.approx((1 - 1 / 6) / 2)}
    assert total["reward_mean"] == pytest.approx(0.3125) and total["response_tokens_mean"] == 2.5
    assert passed([0.4, 0.5, 0.6], 0.5) == 2
    with pytest.raises(ValueError, match="no evaluated prompts"):
        overall([], ks=[1])
