"""memory.py: per-GPU parameters, gradients, optimizer state and activations of a layout, against numbers
worked out by hand for the tiny GPT-OSS, and the invariant that a layout's GPUs hold the whole model."""

import pytest

from offpolicy.learner.backends.megatron import memory as M
from offpolicy.learner.backends.megatron.families import from_hf
from tests.megatron_workers import TINY

G = from_hf(TINY["gpt_oss"])  # h 64, 4 heads / 2 KV of 16, 4 experts top-2 of FFN 32, vocab 61, 4 layers


def test_stage_params_by_hand():
    """Per layer: attention 64*128 + 64*64 + 128 (qkv/o weights, qkv bias) + 64 (o bias) + 128 (norms) + 4 sinks
    = 12612; router 4 * 65 = 260; an expert 3*64*32 + 2*32 + 64 = 6272. PP2 x EP2: 2 layers, 2 experts each."""
    lay = M.Layout(tp=1, pp=2, ep=2, world=4)
    assert M.stage_params(G, lay, 0) == (2 * 12612 + 2 * 260 + 61 * 64, 2 * 2 * 6272)
    assert M.stage_params(G, lay, 1) == (2 * 12612 + 2 * 260 + 64 + 61 * 64, 2 * 2 * 6272)
    # TP2 splits qkv/o weights, qkv bias and sinks, and pads the vocabulary to 62
    dense, _ = M.stage_params(G, M.Layout(tp=2, pp=1, ep=1, world=2), 0)
    assert dense == 4 * ((8192 + 4096 + 128) // 2 + 64 + 128 + 2 + 260) + 2 * 31 * 64 + 64


@pytest.mark.parametrize("cfg", [TINY["gpt_oss"], M.GPT_OSS_20B, M.GPT_OSS_120B], ids=["tiny", "20b", "120b"])
def test_the_gpus_of_a_layout_hold_the_whole_model(cfg):
    arch = from_hf(cfg)
    lay = M.Layout(tp=1, pp=4, ep=4, world=16)
    total = sum(d + e * lay.ep for d, e in (M.stage_params(arch, lay, s) for s in range(lay.pp)))
    assert total == arch.num_params()


def test_memory_by_hand():
    """Stage 0 of PP2 x EP2 x DP2 (world 4; bf16, distributed optimizer: dense state over dp 2, experts over
    edp 1), a micro-batch of 64 tokens in sequences of 16, local attention, no recompute, SequentialMLP
    experts, logit blocks of 1000 bytes."""
    lay = M.Layout(tp=1, pp=2, ep=2, world=4)
    micro = M.Micro(tokens=64, seq_len=16, microbatches=8, chunk_bytes=1000, experts="sequential")
    dense, expert = 2 * 12612 + 2 * 260 + 61 * 64, 2 * 2 * 6272
    # per layer, attention: norm input 64*(64*2 + 4), QKV input 64*64*2, RoPE tables 64*4*16*2, q and k/v repeated
    # to the 4 heads 64*3*64*2, context 64*64*2, scores 4 seqs * 4 heads * 16 * 17 * 6 bytes;
    # MoE: norm input 64*(64*2 + 4), router input 64*64*2, top-2 64*2*12, per copy (2*64 of them) the experts'
    # input 64*2, GPT-OSS's 8 expert values 8*32*2 under SequentialMLP and 18 bytes of routing
    attn = {"attention.norm_input": 8448, "attention.qkv_input": 8192, "attention.rope": 8192,
            "attention.qkv": 24576, "attention.context": 8192, "attention.lse": 0, "attention.qk_norm": 0,
            "attention.scores": 26112}
    moe = {"moe.norm_input": 8448, "moe.router_input": 8192, "moe.router": 1536, "moe.dispatched": 16384,
           "moe.expert_values": 65536, "moe.routing": 2304}
    terms = M.layer_terms(G, lay, micro)
    assert {n: v for n, v in terms.items() if not n.startswith("dense.")} == {**attn, **moe}
    per_layer = sum(attn.values()) + sum(moe.values())
    m = M.per_gpu(G, lay, micro)
    assert m.stage == 0 and m.params == dense + expert
    assert (m.param_bytes, m.grad_bytes) == (2 * (dense + expert), 4 * (dense + expert))
    assert m.optimizer_bytes == dense * 12 // 2 + expert * 12
    assert m.activation_bytes == 2 * 2 * per_layer  # 2 micro-batches in flight on stage 0, 2 layers
    last = M.activations(G, lay, micro, 1)
    assert last == 1 * 2 * per_layer + 4 * 1000  # one in flight, plus four logit blocks
    full = M.activations(G, lay, M.Micro(tokens=64, seq_len=16, recompute="full", chunk_bytes=1000,
                                         experts="sequential"), 1)
    assert full == 2 * 64 * 64 * 2 + per_layer + 4 * 1000  # layer inputs + one layer again + logit blocks
    # flash: q/k/v as they are (64*(64 + 2*32)*2) instead of k and v repeated, the log-sum-exp 64*4*4, no scores
    flash = M.Micro(tokens=64, seq_len=16, attention="flash", chunk_bytes=1000, experts="sequential")
    assert M.activations(G, lay, flash, 1) == last - 2 * (24576 - 16384 + 26112 - 1024)
    # the grouped experts' GLU keeps 3 expert-width values a routed copy instead of 8, and each row's expert and
    # two one-hot rows of the 2 local experts (8 + 2*2*2 bytes a copy)
    grouped = M.Micro(tokens=64, seq_len=16, attention="flash", chunk_bytes=1000)
    assert M.activations(G, lay, grouped, 1) == (last - 2 * (24576 - 16384 + 26112 - 1024)
                                                 - 2 * (2 * 64 * 5 * 32 * 2 - 2 * 64 * 16))
    # the loss before issue 17: FULL_LOGIT_COPIES float32 [tokens x vocabulary] copies instead of the blocks
    old = M.Micro(tokens=64, seq_len=16, chunk_bytes=1000, experts="sequential", logits="full")
    assert M.activations(G, lay, old, 1) == last - 4 * 1000 + int(M.FULL_LOGIT_COPIES * 4 * 61 * 64)


def test_the_attention_path_and_a_bad_field_are_named():
    assert M.attention_path("cuda", 2) == "flash"
    assert M.attention_path("cuda", 4) == M.attention_path("cpu", 2) == "local"
    with pytest.raises(ValueError, match="Micro.experts='fused'"):
        M.Micro(tokens=1, seq_len=1, experts="fused")


def test_a_dense_layer_keeps_its_mlp_values():
    """Llama-shaped layers (no experts): norm input and fc1's input 2*T*h*b (and a float32 1/rms), fc1 out +
    fc2 in 3*T*f*b; no residual (an add keeps nothing)."""
    from offpolicy.learner.backends.megatron.families import from_hf as hf

    arch = hf(TINY["llama"])
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_query_groups * d
    micro = M.Micro(tokens=64, seq_len=16, attention="flash", chunk_bytes=0)
    attn = 64 * (2 * h * 2 + 4) + 64 * 4 * d * 2 + 64 * ((q + 2 * kv) + q) * 2 + 64 * arch.num_heads * 4
    mlp = 64 * (2 * h * 2 + 4) + 64 * 3 * f * 2
    assert M.activations(arch, M.Layout(), micro, 0) == arch.num_layers * (attn + mlp)


def test_q_and_k_norms_keep_their_inputs():
    """Qwen3's q/k norms: q's input (a copy) T*q*b, k's (a view that keeps the whole QKV output) T*(q+2kv)*b,
    a float32 1/rms per head."""
    arch = from_hf(TINY["qwen3"])
    q, kv = arch.num_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    terms = M.layer_terms(arch, M.Layout(), M.Micro(tokens=64, seq_len=16, attention="flash"))
    assert terms["attention.qk_norm"] == 64 * ((2 * q + 2 * kv) * 2 + (arch.num_heads + arch.num_query_groups) * 4)


def test_docs_carry_the_seed_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "megatron.md").read_text()
    assert M.seed_table() in text
