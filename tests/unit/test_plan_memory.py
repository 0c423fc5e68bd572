"""offpolicy/plan/memory.py against the peaks recorded in docs/benchmarks.md (and issue 17's H100 re-run).

The logit copies are fitted to one peak (Qwen2.5-0.5B, 16384 tokens: 108.3 GiB); every other
recorded peak is a prediction and must hold within 5 %.
"""

from __future__ import annotations

import pytest

from offpolicy.plan import calibration
from offpolicy.plan.memory import GIB, LearnerLayout, RolloutServerSpec, learner_memory, rollout_memory
from offpolicy.plan.shapes import load_shape

COPIES = calibration.load().get("learner.logit_copies")


@pytest.mark.parametrize("budget, peak_gib", [
    (16384, 108.3),  # docs/benchmarks.md, Megatron learner, one GPU (the fitted point)
    (8192, 58.3),  # issue 17, one H100
    (4096, 33.4),  # issue 17, one H100
])
def test_qwen_05b_one_gpu_peaks(budget, peak_gib):
    q = load_shape("qwen2.5-0.5b")
    m = learner_memory(q, LearnerLayout(1, max_tokens_per_gpu=budget), 512, 32 * 8 * 512, COPIES)
    assert m.total / GIB == pytest.approx(peak_gib, rel=0.05)


# docs/benchmarks.md, Four-GPU runs, Run 1: qwen3-moe-small, 16 groups x 8 x 512 tokens, 16384 per micro-batch
MOE_PEAKS = [((1, 1, 1), 21.04), ((4, 4, 1), 5.55), ((4, 2, 2), 10.52), ((4, 1, 4), 20.38), ((4, 1, 1), 20.29),
             ((2, 1, 2), 20.52), ((2, 1, 1), 20.54), ((2, 2, 1), 10.71)]


@pytest.mark.parametrize("layout, peak_gib", MOE_PEAKS)
def test_moe_layout_peaks(layout, peak_gib):
    gpus, tp, ep = layout
    lay = LearnerLayout(gpus, tp=tp, ep=ep, max_tokens_per_gpu=16384)
    m = learner_memory(load_shape("qwen3-moe-small"), lay, 512, 16 * 8 * 512 // lay.dp, COPIES)
    assert m.total / GIB == pytest.approx(peak_gib, rel=0.05)


def test_static_bytes_by_hand():
    # a dense 1-GPU learner holds 2 + 4 + 12 bytes per parameter; DP4 shards the 12
    q = load_shape("qwen2.5-0.5b")
    one = learner_memory(q, LearnerLayout(1), 512, 16384, COPIES)
    four = learner_memory(q, LearnerLayout(4), 512, 16384, COPIES)
    assert (one.params, one.grads, one.optimizer) == (2 * q.params, 4 * q.params, 12 * q.params)
    assert four.optimizer == pytest.approx(3 * q.params)


def test_pipeline_stages_split_layers_and_the_first_holds_pp_micro_batches():
    s = load_shape("gpt-oss-20b")
    one = learner_memory(s, LearnerLayout(16, pp=1, ep=16), 4096, 10**6, COPIES)
    four = learner_memory(s, LearnerLayout(16, pp=4, ep=4), 4096, 10**6, COPIES)
    assert four.activations == pytest.approx(one.activations)  # 4 in flight x a quarter of the layers
    assert four.params < one.params


def test_rollout_pool_is_what_mem_fraction_leaves_after_the_weights():
    s = load_shape("gpt-oss-20b")
    srv = RolloutServerSpec(tp=4, ep=4, mem_fraction=0.8)
    m = rollout_memory(s, srv, 0.8 * 80 * GIB)
    assert m.params == pytest.approx(2 * s.params / 4)
    assert m.kv_cache == pytest.approx(0.8 * 80 * GIB - m.params)
    assert rollout_memory(s, srv, 5 * GIB).kv_cache == 0.0
