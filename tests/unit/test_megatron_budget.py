"""The auto token budget (offpolicy/learner/backends/megatron/budget.py), by hand on a Llama-3.2-1B shape: the memory
model's per-token terms (memory.ACTIVATION_TERMS, flash attention) x 1.15."""

import pytest

from offpolicy.learner.backends.megatron import budget, families

LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def test_activation_bytes_per_token_by_hand():
    arch = families.from_hf(LLAMA_1B)
    h, d, q, kv, f, heads = 2048, 64, 2048, 512, 8192, 32

    def per_layer(tp: int, sp: int) -> float:  # bytes a token: bf16 values x 2, float32 1/rms and lse x 4
        # norm inputs and the inputs of QKV and fc1 (4 h, over tp under SP), RoPE's 4 tables, q/k/v and context,
        # fc1 out + fc2 in (3 f); two norms' 1/rms, flash's log-sum-exp per head
        return 2 * (4 * h / sp + 4 * d + (2 * q + 2 * kv) / tp + 3 * f / tp) + 4 * 2 / sp + 4 * heads / tp

    assert per_layer(1, 1) == 76424
    assert budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 16 * 76424)
    assert budget.activation_bytes(arch, tp=2, pp=1, sequence_parallel=False) == pytest.approx(
        1.15 * 16 * per_layer(2, 1))  # heads and FFN split, the sequence not
    assert budget.activation_bytes(arch, tp=2, pp=1, sequence_parallel=True) == pytest.approx(
        1.15 * 16 * per_layer(2, 2))
    # pp 2: half the layers, two micro-batches in flight on the first stage
    assert budget.activation_bytes(arch, tp=1, pp=2, sequence_parallel=False) == pytest.approx(1.15 * 16 * 76424)


def test_fill_on_an_80_gb_gpu():
    arch = families.from_hf(LLAMA_1B)
    gib = 1 << 30
    got = budget.fill(arch, free_bytes=66 * gib, total_bytes=79.2 * gib, optimizer_bytes=8 * 1.2358e9,
                      chunk_bytes=gib, tp=1, pp=1, sequence_parallel=False)
    room = 66 * gib - 8 * 1.2358e9 - 4 * gib - 0.10 * 79.2 * gib  # 48.2 GB
    assert got == int(room / (1.15 * 16 * 76424) // 1024) * 1024 == 33792
    assert budget.fill(arch, free_bytes=gib, total_bytes=80 * gib, optimizer_bytes=0, chunk_bytes=gib, tp=1, pp=1,
                       sequence_parallel=False) == 1024  # never below one 1024-token step


def test_gpt_oss_moe_terms_by_hand_and_against_the_h200_measurement():
    from offpolicy.learner.backends.megatron.memory import gpt_oss_slice

    arch = families.from_hf(gpt_oss_slice(2))
    h, d, q, kv, f, heads = 2880, 64, 64 * 64, 8 * 64, 2880, 64
    # attention: norm input and QKV input 2 h, RoPE's tables 4 d, q/k/v and context 2 q + 2 kv (bf16), a 1/rms and
    # the log-sum-exp per head (float32); MoE: norm and router inputs 2 h, a 1/rms, the top-4's indices and
    # probabilities (4 x 12 bytes), 4 copies of (h + c f) bf16 values plus 18 bytes of routing (+ 8 and the 32
    # experts' two one-hot rows under the grouped experts)
    attn = 2 * (2 * h + 4 * d + 2 * q + 2 * kv) + 4 + 4 * heads
    per_layer = attn + 2 * 2 * h + 4 + 4 * 12 + 4 * (2 * (h + 8 * f) + 18)  # c = 8: SequentialMLP's eager GLU
    assert per_layer == 249728  # what autograd saved for a full-size layer on the CPU (docs/megatron.md)
    got = budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False, experts="sequential")
    assert got == pytest.approx(1.15 * 2 * per_layer)
    grouped = attn + 2 * 2 * h + 4 + 4 * 12 + 4 * (2 * (h + 3 * f) + 18 + 8 + 2 * 32 * 2)  # c = 3: the GLU kernel
    assert grouped == 135072  # measured likewise
    assert budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 2 * grouped)
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
