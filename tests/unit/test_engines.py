"""offpolicy/rollout/engines/__init__.py's helpers shared by the engines: the order a prompt's samples are sent in,
and a generate call's prefill counts."""

from __future__ import annotations

import pytest

from offpolicy.rollout.engines import prompt_counts, samples_first, sent_samples_first


@pytest.mark.parametrize("count, group, order", [
    (6, 3, [0, 3, 1, 4, 2, 5]),  # two prompts of three samples: first samples first
    (7, 3, [0, 3, 6, 1, 4, 2, 5]),  # a last group cut short (a retry of fewer rows)
    (4, 1, [0, 1, 2, 3]),  # one sample a row group (vLLM's requests, SGLang's retries): as given
    (0, 4, []),
])
def test_samples_first_sends_every_prompts_first_sample_before_any_second(count, group, order):
    assert samples_first(count, group) == order
    assert sorted(order) == list(range(count))  # every row once


def test_the_answers_come_back_in_row_order():
    sent = []

    def call(rows, sampling):
        sent.append((rows, sampling))
        return [f"{r}:{s}" for r, s in zip(rows, sampling)]

    rows, sampling = ["a0", "a1", "b0", "b1"], [0, 1, 2, 3]
    assert sent_samples_first(call, rows, sampling, 2) == ["a0:0", "a1:1", "b0:2", "b1:3"]
    assert sent == [(["a0", "b0", "a1", "b1"], [0, 2, 1, 3])]  # each row with its own sampling params
    assert sent_samples_first(lambda r, s: {"error": "x"}, rows, sampling, 2) == {"error": "x"}  # for the caller
    assert sent_samples_first(lambda r, s: r[:3], rows, sampling, 2) == ["a0", "b0", "a1"]  # to refuse as it came


def test_prompt_counts_take_only_whole_numbers_that_fit():
    assert prompt_counts(40, 32) == {"prompt_tokens": 40, "cached_tokens": 32}
    for bad in ((40, None), (None, 3), (40, 41), (40, -1), ("40", 3)):
        assert prompt_counts(*bad) == {}, bad
