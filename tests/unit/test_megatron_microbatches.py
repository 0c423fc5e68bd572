"""The fewest micro-batches of a pipeline-parallel step (offpolicy/learner/backends/megatron/microbatches.py)."""

import numpy as np

from offpolicy.learner.backends.megatron import microbatches
from offpolicy.learner.backends.megatron.batching import Row, plan


def _rows(lengths):
    return [Row(np.zeros(n - 1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32), 0.0) for n in lengths]


def test_auto_is_four_micro_batches_a_stage_and_nothing_without_pipeline_stages():
    assert microbatches.minimum("auto", 1) == 1 and microbatches.minimum(8, 1) == 1
    assert microbatches.minimum("auto", 2) == 8 and microbatches.minimum("auto", 4) == 16
    assert microbatches.minimum(3, 2) == 3 and microbatches.minimum(1, 4) == 1


def test_the_budget_is_lowered_to_fill_the_micro_batches_but_never_below_the_longest_row():
    assert microbatches.budget(32768, 16384, 8, 512) == 4096  # the GPT-OSS slice's PP2 x EP2 rank share: 2 -> 8
    assert microbatches.budget(32768, 2048, 8, 512) == 2048  # already small enough
    assert microbatches.budget(32768, 16384, 8, 6000) == 6000  # a row is never split
    assert microbatches.budget(32768, 16384, 1, 512) == 16384  # pp_microbatches 1: the budget alone
    assert microbatches.budget(32768, 0, 8, 512) == 0  # micro-batches counted in groups: untouched


def test_a_lowered_budget_gives_each_rank_at_least_that_many_micro_batches():
    rng = np.random.default_rng(0)
    rows = _rows(rng.integers(200, 700, size=128).tolist())
    total = sum(r.length for r in rows)
    for dp, fewest in ((1, 8), (2, 8), (2, 16)):
        budget = microbatches.budget(total / dp, 1 << 20, fewest, max(r.length for r in rows))
        for packed in (True, False):
            cut = plan(rows, dp, max_tokens=int(budget), rows_per_micro=1, packed=packed)
            assert all(len(rank) >= fewest for rank in cut), (dp, fewest, packed, [len(r) for r in cut])
    assert len(plan(rows, 2, max_tokens=1 << 20, rows_per_micro=1, packed=True)[0]) == 1  # before: one a rank


def test_the_bubble_shrinks_with_micro_batches():
    assert microbatches.bubble(2, 1) == 0.5 and microbatches.bubble(2, 2) == 1 / 3
    assert abs(microbatches.bubble(2, 8) - 1 / 9) < 1e-12 and microbatches.bubble(1, 1) == 0
