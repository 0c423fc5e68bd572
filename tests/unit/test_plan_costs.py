"""offpolicy/plan/costs.py and calibration.py: the part models reproduce the figures they were fitted to,
and their shapes (long tail, recompute, relay checksum) hold by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from offpolicy.plan import calibration, costs
from offpolicy.plan.hardware import DEVICES, Cluster
from offpolicy.plan.memory import LearnerLayout, RolloutServerSpec
from offpolicy.plan.shapes import load_shape

CAL = calibration.load()


def test_every_entry_names_its_source_and_kind():
    for name, e in CAL.entries.items():
        assert e.kind in calibration.KINDS and len(e.source) > 20, name


def test_decode_efficiency_reproduces_the_public_sglang_figure():
    # gpustack: SGLang, GPT-OSS-20B (MXFP4 experts) on one H100, 1000 requests in flight, 215 + 196 tokens:
    # 13,804 output tokens/s at peak
    s = load_shape("gpt-oss-20b")
    t = costs.decode_step_s(s, RolloutServerSpec(tp=1, expert_bits=4.25), DEVICES["h100"], CAL, 1000, 215 + 196 / 2)
    assert 1000 / t == pytest.approx(13804, rel=0.01)


def test_batch_one_step_is_the_public_latency():
    # LMSYS: gpt-oss-120b MXFP4 on H100 (TP4) 318.53 tokens/s at batch 1
    s = load_shape("gpt-oss-120b")
    t = costs.decode_step_s(s, RolloutServerSpec(tp=4, expert_bits=4.25), DEVICES["h100"], CAL, 1, 1000)
    assert 1 / t == pytest.approx(318.53, rel=0.01)


def test_a_lease_of_equal_lengths_is_prefill_plus_steps_and_a_long_tail_costs_more():
    s, dev = load_shape("gpt-oss-20b"), DEVICES["h100"]
    srv = RolloutServerSpec(tp=4, ep=4)
    pool = 50 * 2**30
    fixed = np.full(64, 1000)
    t = costs.sglang_lease_s(s, srv, dev, CAL, fixed, 512, 8, pool)
    by_hand = costs.prefill_s(s, srv, dev, CAL, 8 * 512) + 1000 * costs.decode_step_s(s, srv, dev, CAL, 64, 512 + 500)
    assert t == pytest.approx(by_hand, rel=1e-9)
    tail = fixed.copy()
    tail[0] = 8000  # the same tokens but one row 8x longer: the lease waits for it at batch 1
    assert costs.sglang_lease_s(s, srv, dev, CAL, tail, 512, 8, pool) > t + 6000 * costs.decode_step_s(
        s, srv, dev, CAL, 1, 512 + 5000) * 0.99


def test_max_running_queues_rows():
    s, dev = load_shape("gpt-oss-20b"), DEVICES["h100"]
    few = RolloutServerSpec(tp=4, ep=4, max_running=32)
    many = RolloutServerSpec(tp=4, ep=4, max_running=512)
    lengths = np.full(128, 500)
    assert costs.sglang_lease_s(s, few, dev, CAL, lengths, 512, 16, 5e10) > \
        3.5 * costs.sglang_lease_s(s, many, dev, CAL, lengths, 512, 16, 5e10) / 1.5


def test_mfu_hits_the_measured_micro_batches():
    assert costs.mfu(CAL, 16384) == CAL.get("learner.mfu_16384")
    assert costs.mfu(CAL, 8192) == CAL.get("learner.mfu_8192")
    assert CAL.get("learner.mfu_4096") < costs.mfu(CAL, 6000) < CAL.get("learner.mfu_8192")


def test_mfu_goes_from_the_narrow_curve_to_the_wide_figure_with_the_width():
    wide = CAL.get("learner.mfu_wide_8192")
    assert costs.mfu(CAL, 8192, 896) == CAL.get("learner.mfu_8192") == costs.mfu(CAL, 8192, 512)
    assert costs.mfu(CAL, 8192, 2880) == wide == costs.mfu(CAL, 8192, 5120)
    # smaller micro-batches along the narrow curve's shape (assumed)
    assert costs.mfu(CAL, 4096, 2880) == pytest.approx(wide * CAL.get("learner.mfu_4096") / CAL.get("learner.mfu_8192"))
    assert CAL.get("learner.mfu_8192") < costs.mfu(CAL, 8192, 2048) < wide


def test_sequence_parallel_halves_the_tokens_a_gpu_computes():
    s, cl = load_shape("gpt-oss-20b"), Cluster(1, 4, DEVICES["h200"])
    ep4 = costs.learner_step(s, LearnerLayout(4, ep=4, max_tokens_per_gpu=8192), cl, CAL, 65536, 512)
    tp2 = costs.learner_step(s, LearnerLayout(4, tp=2, ep=2, max_tokens_per_gpu=8192), cl, CAL, 65536, 512)
    assert tp2["compute"] == pytest.approx(ep4["compute"] * costs.mfu(CAL, 8192, 2880) / costs.mfu(CAL, 4096, 2880))
    assert ep4["moe_overhead"] == 0.0  # the grouped experts: no per-call term


def test_one_gpu_dense_step_is_flops_over_mfu_and_recompute_adds_work():
    q, cl = load_shape("qwen2.5-0.5b"), Cluster(1, 8, DEVICES["h200"])
    tokens = 32 * 8 * 512
    r = costs.learner_step(q, LearnerLayout(1, max_tokens_per_gpu=16384), cl, CAL, tokens, 512)
    assert r["total"] == pytest.approx(tokens * q.train_flops_per_token(512) / (0.141 * 989e12))
    assert r["total"] == pytest.approx(2.91, rel=0.02)  # the measured step it was calibrated on
    full = costs.learner_step(q, LearnerLayout(1, max_tokens_per_gpu=16384, recompute="full"), cl, CAL, tokens, 512)
    assert full["total"] == pytest.approx(r["total"] * 4 / 3)


@pytest.mark.parametrize("gb, mode, seconds", [(0.97, "sha256", 0.97 / 3.6), (3.99, "sha256", 3.99 / 5.47),
                                                (0.97, "fast", 0.97 / 47.8), (15.97, "fast", 15.97 / 53.8)])
def test_publish_line_goes_through_the_weights_benchmark(gb, mode, seconds):
    fixed, rate = CAL.get(f"weights.publish.{mode}.fixed_s"), CAL.get(f"weights.publish.{mode}.gbps")
    assert fixed + gb / rate == pytest.approx(seconds, rel=0.01)


def test_relay_is_bound_by_sha256_only_with_checksums():
    cl = Cluster(8, 8, DEVICES["h100"], inter_gbps=50)
    size = 42e9
    assert costs.relay_s(size, 1, cl, CAL, True) == pytest.approx(size / 1.3e9)
    assert costs.relay_s(size, 1, cl, CAL, False) == pytest.approx(size / 2.98e9)
    assert costs.relay_s(size, 0, cl, CAL, True) == 0.0
    assert costs.relay_s(size, 6, cl, CAL, True) - costs.relay_s(size, 1, cl, CAL, True) < 1.0  # pipelined chain


def test_from_bench_fits_lines_to_the_json_outputs(tmp_path):
    rows = [{"bytes": int(gb * 1e9), "publish": [{"mode": "sha256", "mean_seconds": 0.1 + gb / 5}],
             "loads": [{"mode": "staged", "seconds": 0.01 + gb / 40}]} for gb in (1, 4, 16)]
    (tmp_path / "weights.json").write_text(json.dumps({"command": "bench weights", "machine": {}, "rows": rows}))
    rollout = {"command": "c", "params_m": 109.5, "rows": 64, "device": "cuda", "new_tokens": 256,
               "results": {"engine_static": {"seconds": 0.512}}}
    (tmp_path / "rollout.json").write_text(json.dumps(rollout))
    got = calibration.from_bench(tmp_path)
    assert got["weights.publish.sha256.gbps"].value == pytest.approx(5.0)
    assert got["weights.publish.sha256.fixed_s"].value == pytest.approx(0.1)
    assert got["weights.load.staged.gbps"].value == pytest.approx(40.0)
    assert got["torch_engine.static.step_s"].value == pytest.approx(0.002)
