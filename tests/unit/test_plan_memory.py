"""offpolicy/plan/memory.py: the planner's learner memory is the one model's (learner/backends/megatron/memory.py, held
against every recorded peak by test_megatron_memory_peaks.py) for the path the learner runs on a GPU; the
rollout server's KV pool."""

from __future__ import annotations

import pytest

from offpolicy.learner.backends.megatron import memory as M
from offpolicy.plan.memory import GIB, LearnerLayout, RolloutServerSpec, learner_memory, rollout_memory
from offpolicy.plan.shapes import from_config, load_shape
from tests.unit.test_megatron_memory_peaks import LLAMA_1B


def test_learner_memory_is_the_one_models_flash_grouped_chunked_path():
    s = load_shape("gpt-oss-20b")
    lay = LearnerLayout(16, tp=2, pp=2, ep=4, max_tokens_per_gpu=8192, recompute="selective")
    m = learner_memory(s, lay, 4096, 40000)
    # pp 2: the rank's 40,000 tokens in at least 8 micro-batches (learner.megatron.pp_microbatches auto), 5,000 each
    ref = M.per_gpu(s.arch, M.Layout(tp=2, pp=2, ep=4, world=16), M.Micro(
        tokens=5000, seq_len=4096, microbatches=8, attention="flash", recompute="selective", experts="grouped"))
    assert m.total == ref.total_bytes
    assert (m.params, m.grads, m.optimizer) == (ref.param_bytes, ref.grad_bytes, ref.optimizer_bytes)


@pytest.mark.parametrize("budget, per_rank, peak_gib", [
    (16384, 120244, 41.5),  # docs/benchmarks.md, Megatron learner speed (issue 17): packed 16,384, one H100
    (23552, 120244, 49.7),  # the same, packed auto (23,552 tokens)
    (61440, 120244, 93.2),  # the same on one H200, packed auto (61,440 tokens)
])
def test_a_one_gpu_learner_of_today_against_its_measured_peaks(budget, per_rank, peak_gib):
    m = learner_memory(from_config("llama-1b", LLAMA_1B), LearnerLayout(1, max_tokens_per_gpu=budget), 1792, per_rank)
    assert m.total / GIB == pytest.approx(peak_gib, rel=0.15)


def test_static_bytes_by_hand():
    # a dense 1-GPU learner holds 2 + 4 + 12 bytes per parameter; DP4 shards the 12
    q = load_shape("qwen2.5-0.5b")
    one = learner_memory(q, LearnerLayout(1), 512, 16384)
    four = learner_memory(q, LearnerLayout(4), 512, 16384)
    assert (one.params, one.grads, one.optimizer) == (2 * q.params, 4 * q.params, 12 * q.params)
    assert four.optimizer == pytest.approx(3 * q.params)


def test_pipeline_stages_split_layers_and_the_first_holds_pp_micro_batches():
    s = load_shape("gpt-oss-20b")
    one = learner_memory(s, LearnerLayout(16, pp=1, ep=16), 4096, 10**6)
    four = learner_memory(s, LearnerLayout(16, pp=4, ep=4), 4096, 10**6)
    # 4 in flight x a quarter of the layers (the grouped experts' one-hot rows of E/ep local experts differ a little)
    assert four.activations == pytest.approx(one.activations, rel=2e-3)
    assert four.params < one.params


def test_rollout_pool_is_what_mem_fraction_leaves_after_the_weights():
    s = load_shape("gpt-oss-20b")
    srv = RolloutServerSpec(tp=4, ep=4, mem_fraction=0.8)
    m = rollout_memory(s, srv, 0.8 * 80 * GIB)
    assert m.params == pytest.approx(2 * s.params / 4)
    assert m.kv_cache == pytest.approx(0.8 * 80 * GIB - m.params)
    assert rollout_memory(s, srv, 5 * GIB).kv_cache == 0.0
