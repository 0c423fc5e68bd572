"""Token-budget micro-batches, padded and packed (offpolicy/learner/backends/megatron/batching.py; no megatron needed)."""

import numpy as np
import pytest
import torch

from offpolicy.learner.backends.megatron import batching

CPU = torch.device("cpu")


def _rows(lengths, prompt=2):
    return [batching.Row(np.zeros(prompt, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32), 0.5)
            for n in lengths]


def _row(prompt, response, adv=1.0):
    return batching.Row(np.array(prompt, np.int32), np.array(response, np.int32),
                        -np.arange(1, len(response) + 1, dtype=np.float32), adv)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plan_keeps_every_row_once_within_budget(dp, packed):
    rows = _rows([1, 7, 3, 12, 5, 5, 2, 9, 30])
    plan = batching.plan(rows, dp, max_tokens=40, rows_per_micro=0, packed=packed)
    assert len({len(r) for r in plan}) == 1  # same number of micro-batches on every DP rank
    real = [row for rank in plan for micro in rank for row in micro if len(row.response)]
    assert sorted(map(id, real)) == sorted(map(id, rows))
    for rank in plan:
        for micro in rank:
            assert len(micro) == 1 or batching.tokens(micro, packed=packed) <= 40


def test_packing_processes_only_real_tokens():
    rows = _rows([30, 2, 2, 2, 2, 2, 2, 2, 2, 10, 10])  # lengths 32, 8 x 4, 2 x 12: 88 tokens
    padded = batching.plan(rows, 1, max_tokens=40, rows_per_micro=0)[0]
    packed = batching.plan(rows, 1, max_tokens=40, rows_per_micro=0, packed=True)[0]
    assert [sum(r.length for r in m) for m in packed] == [40, 40, 8]  # first fit, longest first
    assert [batching.tokens(m, packed=False) for m in padded] == [32, 36, 28]  # [32], [12, 12, 4], [4] x 7
    assert sum(batching.tokens(m, packed=True) for m in packed) == 88
    assert batching.tokens(packed[2], packed=True, multiple=16) == 16


def test_pad_indexes_the_logit_before_each_response_token():
    rows = [_row([5, 6], [7, 8, 9], adv=1.0), _row([4], [3], adv=-1.0)]
    t = batching.pad(rows, CPU)
    assert t["ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    # logits at position p predict token p + 1; hidden states are [s, b] flattened: index p * b + row
    assert t["tok"].tolist() == [7, 8, 9, 3]
    assert t["sel"].tolist() == [1 * 2 + 0, 2 * 2 + 0, 3 * 2 + 0, 0 * 2 + 1]
    assert t["slot"].tolist() == [0, 1, 2, 3] and t["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert t["old"].tolist() == [[-1, -2, -3], [-1, 0, 0]] and t["adv"].tolist() == [1, -1]


def test_concat_lays_rows_end_to_end_with_positions_restarting():
    rows = [_row([5, 6], [7, 8, 9]), _row([4], [3])]
    t, bounds = batching.concat(rows, CPU, multiple=4)
    assert t["ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3, 0]] and bounds == [0, 5, 7, 8]  # pad: a document of its own
    assert t["positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert t["tok"].tolist() == [7, 8, 9, 3] and t["sel"].tolist() == [1, 2, 3, 5]
    assert t["slot"].tolist() == [0, 1, 2, 3] and t["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batching.concat(rows, CPU)[1] == [0, 5, 7]


def test_pad_rounds_up_to_a_multiple_of_tp_under_sequence_parallel():
    mb = batching.pad([_row([0, 1, 2], [0, 1])], CPU, multiple=4)
    assert mb["ids"].shape == (1, 8) and mb["sel"].tolist() == [2, 3] and mb["ids"][0, 5:].tolist() == [0, 0, 0]


def test_an_empty_micro_batch_has_no_response_tokens():
    plan = batching.plan(_rows([3]), 2, max_tokens=40, rows_per_micro=0, packed=True)
    empty = plan[1][0]
    t, bounds = batching.concat(empty, CPU)
    assert bounds == [0, 1] and t["tok"].numel() == 0 and t["mask"].shape == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_response_tensors_take_the_learner_dtype_and_exact_advantages(dtype):
    """The response tensors in the learner's dtype (advantages from their float64 values: a float64 learner
    keeps them exact), the index tensors int64, built on the host by numpy."""
    rows = [_row([5, 6], [7, 8, 9], adv=0.1), _row([4], [3], adv=-1 / 3)]
    for t in (batching.pad(rows, CPU, dtype), batching.concat(rows, CPU, dtype)[0]):
        assert {t[k].dtype for k in ("old", "mask", "adv")} == {dtype}
        assert {t[k].dtype for k in ("ids", "positions", "tok", "sel", "slot")} == {torch.int64}
        assert t["adv"].tolist() == torch.tensor([0.1, -1 / 3], dtype=dtype).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("multiple", [1, 4])
def test_concat_on_the_device_equals_the_hosts(dtype, multiple):
    """A GPU's concat makes the index tensors on the device (`_concat_on_device`, run here on the CPU): the same
    tensors, dtypes and bounds as numpy's, for random rows, a pad document, and an empty micro-batch."""
    rng = np.random.default_rng(0)
    rows = [batching.Row(rng.integers(0, 1000, p).astype(np.int32), rng.integers(0, 1000, r).astype(np.int32),
                         rng.standard_normal(r).astype(np.float32), float(rng.standard_normal()))
            for p, r in zip(rng.integers(1, 9, 13), rng.integers(0, 17, 13))]
    empty = batching.plan(_rows([3]), 2, max_tokens=40, rows_per_micro=0, packed=True)[1][0]
    for case in (rows, rows[:1], empty):
        want, want_bounds = batching.concat_host(case, CPU, dtype, multiple)
        got, bounds = batching._concat_on_device(case, CPU, dtype, multiple)
        assert bounds == want_bounds and got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
