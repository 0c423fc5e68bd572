"""The auto token budget (offpolicy/learner/backends/megatron/budget.py), by hand on a Llama-3.2-1B shape: the memory
model's per-token terms (memory.ACTIVATION_TERMS, flash attention) x 1.15."""

import pytest

from offpolicy.learner.backends.megatron import budget, families

LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def test_activation_bytes_per_token_by_hand():
    arch = families.from_hf(LLAMA_1B)
    # 5 h (norm inputs, QKV input, residuals), 3 q + 3 kv (q/k/v, rotated q/k, context), 3 f (fc1 out, fc2 in)
    per_layer = 5 * 2048 + 3 * 2048 + 3 * 512 + 3 * 8192  # 42,496 bf16 values a token
    assert budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 16 * 2 * per_layer)
    tp2 = 5 * 2048 + 3 * 1024 + 3 * 256 + 3 * 4096  # heads and FFN split, the sequence not
    assert budget.activation_bytes(arch, tp=2, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 16 * 2 * tp2)
    sp = 5 * 1024 + 3 * 1024 + 3 * 256 + 3 * 4096
    assert budget.activation_bytes(arch, tp=2, pp=1, sequence_parallel=True) == pytest.approx(1.15 * 16 * 2 * sp)
    # pp 2: half the layers, two micro-batches in flight on the first stage
    assert budget.activation_bytes(arch, tp=1, pp=2, sequence_parallel=False) == pytest.approx(1.15 * 16 * 2 * per_layer)


def test_fill_on_an_80_gb_gpu():
    arch = families.from_hf(LLAMA_1B)
    gib = 1 << 30
    got = budget.fill(arch, free_bytes=66 * gib, total_bytes=79.2 * gib, optimizer_bytes=8 * 1.2358e9,
                      chunk_bytes=gib, tp=1, pp=1, sequence_parallel=False)
    room = 66 * gib - 8 * 1.2358e9 - 4 * gib - 0.10 * 79.2 * gib  # 48.2 GB
    assert got == int(room / (1.15 * 16 * 2 * 42496) // 1024) * 1024 == 30720
    assert budget.fill(arch, free_bytes=gib, total_bytes=80 * gib, optimizer_bytes=0, chunk_bytes=gib, tp=1, pp=1,
                       sequence_parallel=False) == 1024  # never below one 1024-token step


def test_gpt_oss_moe_terms_by_hand_and_against_the_h200_measurement():
    from offpolicy.learner.backends.megatron.memory import gpt_oss_slice

    arch = families.from_hf(gpt_oss_slice(2))
    h, q, kv, f, e = 2880, 64 * 64, 8 * 64, 2880, 32
    # attention 3 h + 3 q + 3 kv; MoE 3 h, float32 router logits (2 e bf16 values), 4 copies of (2 h + c f)
    per_layer = 6 * h + 3 * q + 3 * kv + 2 * e + 4 * (2 * h + 7.5 * f)  # c = 7.5: SequentialMLP's eager GLU
    got = budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False, experts="sequential")
    assert got == pytest.approx(1.15 * 2 * 2 * per_layer)
    grouped = 6 * h + 3 * q + 3 * kv + 2 * e + 4 * (2 * h + 3 * f)  # c = 3: the grouped experts' compiled GLU
    assert budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 2 * 2 * grouped)
    # measured (docs/benchmarks.md): 36.8 GiB of activations for 68,818 packed tokens, H200, one micro-batch
    measured = 36.8 * (1 << 30) / 68818
    assert measured < got < 1.3 * measured  # safe, not wasteful
    # the H100 that ran out of memory with the old terms: about 52.5 GiB free at step 1, 2.80B parameters
    gib = 1 << 30
    tokens = budget.fill(arch, free_bytes=52.5 * gib, total_bytes=79.2 * gib, optimizer_bytes=8 * 2.8046e9,
                         chunk_bytes=gib, tp=1, pp=1, sequence_parallel=False, experts="sequential")
    states = (2 + 4 + 4 + 8) * 2.8046e9  # bf16 weights, fp32 grads, fp32 main params, Adam
    assert states + tokens * measured + 4 * gib < 79.2 * gib
    assert tokens >= 16384


def test_the_publish_snapshot_is_counted_against_the_budget():
    """weights.overlap_publish keeps a snapshot of each rank's share of the weights while a step trains:
    its bytes (model dtype, plus each low-bit format's copy) come off the room for activations."""
    from offpolicy.learner.backends.megatron import memory

    arch = families.from_hf(LLAMA_1B)
    gib = 1 << 30
    snap = memory.publish_snapshot_bytes(2 * 1.2358e9)
    assert snap == 2 * 1.2358e9
    assert memory.publish_snapshot_bytes(100, ["fp8", "mxfp4"]) == pytest.approx(180)
    kw = dict(free_bytes=66 * gib, total_bytes=79.2 * gib, optimizer_bytes=8 * 1.2358e9, chunk_bytes=gib, tp=1, pp=1,
              sequence_parallel=False)
    per_token = budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False)
    room = 66 * gib - 8 * 1.2358e9 - 4 * gib - 0.10 * 79.2 * gib
    assert budget.fill(arch, **kw) == int(min(room / per_token // 1024, 128) * 1024)
    assert budget.fill(arch, **kw, snapshot_bytes=snap) == int(min((room - snap) / per_token // 1024, 128) * 1024)
    assert budget.fill(arch, **kw, snapshot_bytes=snap) < budget.fill(arch, **kw)
