"""offpolicy/plan/shapes.py: parameter counts by part, active parameters, FLOPs and KV bytes."""

from __future__ import annotations

import json

import pytest

from offpolicy.learner.backends.megatron.arch import ArchError
from offpolicy.plan.shapes import PRESETS, load_shape


def test_gpt_oss_counts_match_the_model_cards():
    # openai model cards: gpt-oss-20b 21 B parameters, 3.6 B active; gpt-oss-120b 117 B, 5.1 B active (both without
    # the input embedding in "active"; Arch's count leaves out expert/o_proj/router biases and sinks)
    s20, s120 = load_shape("gpt-oss-20b"), load_shape("gpt-oss-120b")
    assert s20.params == pytest.approx(20.91e9, rel=2e-3) and s120.params == pytest.approx(116.8e9, rel=2e-3)
    emb = 201088 * 2880
    assert s20.active_params - emb == pytest.approx(3.61e9, rel=5e-3)
    assert s120.active_params - emb == pytest.approx(5.13e9, rel=5e-3)
    assert (s20.sliding_layers, s20.sliding_window, s20.full_layers) == (12, 128, 12)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parts_add_up_to_the_arch_count(name):
    s = load_shape(name)
    assert s.dense_params + s.expert_params == s.arch.num_params()
    assert s.active_params <= s.params


def test_flops_per_token_is_the_benchmarks_definition():
    # benchmarks/megatron_learner.py: 6 x params + 12 x layers x heads x head_dim x seq = 3.10 GFLOP at 512
    q = load_shape("qwen2.5-0.5b")
    assert q.params == 494_032_768
    assert q.train_flops_per_token(512) == 6 * 494_032_768 + 12 * 24 * 14 * 64 * 512


def test_kv_bytes_cap_the_sliding_layers_at_the_window():
    s = load_shape("gpt-oss-20b")
    per = 2 * 8 * 64 * 2  # K and V, 8 KV heads of 64, bf16
    assert s.kv_bytes(1000) == per * (12 * 1000 + 12 * 128)
    assert s.kv_bytes(100) == per * 24 * 100
    assert s.weight_bytes(16) == 2 * s.params
    assert s.weight_bytes(4.25) == pytest.approx(2 * s.dense_params + s.expert_params * 4.25 / 8)


def test_a_config_file_or_directory_loads_and_an_unknown_name_says_what_to_give(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(PRESETS["qwen3-moe-small"]))
    assert load_shape(str(tmp_path / "m")).expert_params == 8 * 8 * 3 * 512 * 512
    with pytest.raises(ArchError, match="not a preset"):
        load_shape("gpt-oss-21b")
