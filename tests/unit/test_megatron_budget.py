"""The auto token budget (offpolicy/backends/megatron/budget.py), by hand on a Llama-3.2-1B shape."""

import pytest

from offpolicy.backends.megatron import arch as A
from offpolicy.backends.megatron import budget

LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def test_activation_bytes_per_token_by_hand():
    arch = A.from_hf(LLAMA_1B)
    per_layer = 6 * 2048 + 2 * 2048 + 3 * 512 + 3 * 8192  # 42,496 bf16 values a token
    assert budget.activation_bytes(arch, tp=1, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 16 * 2 * per_layer)
    tp2 = 6 * 2048 + 2 * 1024 + 3 * 256 + 3 * 4096  # heads and FFN split, the sequence not
    assert budget.activation_bytes(arch, tp=2, pp=1, sequence_parallel=False) == pytest.approx(1.15 * 16 * 2 * tp2)
    sp = 6 * 1024 + 2 * 1024 + 3 * 256 + 3 * 4096
    assert budget.activation_bytes(arch, tp=2, pp=1, sequence_parallel=True) == pytest.approx(1.15 * 16 * 2 * sp)
    # pp 2: half the layers, two micro-batches in flight on the first stage
    assert budget.activation_bytes(arch, tp=1, pp=2, sequence_parallel=False) == pytest.approx(1.15 * 16 * 2 * per_layer)


def test_fill_on_an_80_gb_gpu():
    arch = A.from_hf(LLAMA_1B)
    gib = 1 << 30
    got = budget.fill(arch, free_bytes=66 * gib, total_bytes=79.2 * gib, optimizer_bytes=8 * 1.2358e9,
                      chunk_bytes=gib, tp=1, pp=1, sequence_parallel=False)
    room = 66 * gib - 8 * 1.2358e9 - 4 * gib - 0.10 * 79.2 * gib  # 48.2 GB
    assert got == int(room / (1.15 * 16 * 2 * 42496) // 1024) * 1024 == 30720
    assert budget.fill(arch, free_bytes=gib, total_bytes=80 * gib, optimizer_bytes=0, chunk_bytes=gib, tp=1, pp=1,
                       sequence_parallel=False) == 1024  # never below one 1024-token step
