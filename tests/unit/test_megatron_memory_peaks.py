"""The learner's memory model (offpolicy/learner/backends/megatron/memory.py) against every learner peak the docs record.

Each row: where it is recorded, the GPU, the model, the layout, the largest micro-batch's tokens, the code
path it ran (attention, experts module, loss) and the measured peak (`torch.cuda.max_memory_allocated`,
GiB). The estimate must be within 15 % of each. Left out: `nvidia-smi` figures (docs/benchmarks.md
"Run 2": they count the CUDA context and the allocator's cache, not what the learner allocated).
Rows marked `full` ran the loss before issue 17 (float32 logits of the whole vocabulary, megatron-core's
unfused attention): the model's `logits="full"` term (FULL_LOGIT_COPIES, fitted to issue 4's 108.3 GiB)
covers them. A micro-batch's `tokens` is its budget (or the whole step when the budget holds it), the
sequences of 64-256 + 64-1536-token rows are at most 1792 long, those of the fixed batches 512.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from offpolicy.learner.backends.megatron import budget, memory as M
from offpolicy.learner.backends.megatron.families import from_hf
from offpolicy.plan.shapes import PRESETS

GIB = 1 << 30
# benchmarks/megatron_learner.py's presets: llama-1b (Llama-3.2-1B's shape), qwen3moe-slice (Qwen3-30B-A3B's layers)
LLAMA_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
QWEN3_BODY = dict(model_type="qwen3_moe", vocab_size=2048, hidden_size=2048, intermediate_size=6144,
                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  tie_word_embeddings=False)
SLICE = M.gpt_oss_slice(2)
BODY = {**SLICE, "vocab_size": 2048}
MODELS = {"llama-1b": LLAMA_1B, "gpt-oss-20b": M.GPT_OSS_20B, "gpt-oss slice": SLICE, "gpt-oss body": BODY, "qwen3-30b-a3b body": QWEN3_BODY,
          "qwen2.5-0.5b": PRESETS["qwen2.5-0.5b"], "qwen3-moe-small": PRESETS["qwen3-moe-small"]}


class Peak(NamedTuple):
    source: str
    gpu: str
    model: str
    layout: str  # "1" or "tpN epN" over `gpus`
    gpus: int
    tokens: int  # tokens of the largest micro-batch
    microbatches: int
    attention: str
    experts: str
    logits: str
    peak_gib: float
    grad_bytes: int = 4  # 2: learner.megatron.grad_reduce_in_fp32=false


B24, B17, B4, R1 = ("benchmarks.md MoE grouped experts (issue 24)", "benchmarks.md Megatron learner speed (issue 17)",
                    "benchmarks.md Megatron learner, one GPU (issue 4)", "benchmarks.md Four-GPU runs, Run 1")
MG, DP = "megatron.md GPT-OSS GPU", "deploy.md memory table (issue 17 re-run)"
FULL = "megatron.md GPT-OSS-20B at full size"
PEAKS = [
    Peak(B24, "H100", "gpt-oss body", "1", 1, 59392, 3, "flash", "sequential", "chunked", 59.5),
    Peak(B24, "H100", "gpt-oss body", "1", 1, 60416, 3, "flash", "grouped", "chunked", 48.5),
    Peak(B24, "H100", "gpt-oss slice", "1", 1, 29696, 5, "flash", "sequential", "chunked", 64.2),
    Peak(B24, "H100", "gpt-oss slice", "1", 1, 29696, 5, "flash", "grouped", "chunked", 57.7),
    Peak(B24, "H100", "qwen3-30b-a3b body", "1", 1, 125243, 1, "flash", "sequential", "chunked", 61.8),
    Peak(B24, "H100", "qwen3-30b-a3b body", "1", 1, 125243, 1, "flash", "grouped", "chunked", 61.7),
    Peak(B17 + ", before: main", "H100", "llama-1b", "1", 1, 4096, 30, "local", "sequential", "full", 58.8),
    Peak(B17 + ", padded", "H100", "llama-1b", "1", 1, 16384, 8, "flash", "grouped", "chunked", 42.4),
    Peak(B17 + ", packed", "H100", "llama-1b", "1", 1, 16384, 8, "flash", "grouped", "chunked", 41.5),
    Peak(B17 + ", packed auto", "H100", "llama-1b", "1", 1, 23552, 6, "flash", "grouped", "chunked", 49.7),
    Peak(B17 + ", run 1 packed", "H100", "llama-1b", "1", 1, 16384, 8, "flash", "grouped", "chunked", 47.8),
    Peak(B17 + ", run 1 padded", "H100", "llama-1b", "1", 1, 16384, 8, "flash", "grouped", "chunked", 48.6),
    Peak(B17 + ", run 1 packed 32768", "H100", "llama-1b", "1", 1, 32768, 4, "flash", "grouped", "chunked", 72.9),
    Peak(B17 + ", packed", "H200", "llama-1b", "1", 1, 16384, 8, "flash", "grouped", "chunked", 41.5),
    Peak(B17 + ", padded", "H200", "llama-1b", "1", 1, 16384, 8, "flash", "grouped", "chunked", 42.4),
    Peak(B17 + ", packed auto", "H200", "llama-1b", "1", 1, 61440, 2, "flash", "grouped", "chunked", 93.2),
    Peak(MG + ", padded 8192", "H100", "gpt-oss slice", "1", 1, 8192, 9, "flash", "sequential", "chunked", 57.7),
    Peak(MG + ", packed 8192", "H100", "gpt-oss slice", "1", 1, 8192, 9, "flash", "sequential", "chunked", 57.7),
    Peak(MG + ", packed auto", "H100", "gpt-oss slice", "1", 1, 29696, 3, "flash", "sequential", "chunked", 64.2),
    Peak(MG + ", packed 8192", "H200", "gpt-oss slice", "1", 1, 8192, 9, "flash", "sequential", "chunked", 57.7),
    Peak(MG + ", packed auto", "H200", "gpt-oss slice", "1", 1, 68818, 1, "flash", "sequential", "chunked", 83.7),
    Peak(MG + ", before the packed learner", "H100", "gpt-oss slice", "1", 1, 4096, 17, "local", "sequential", "full",
         71.8),
    Peak(FULL + ", EP4", "H200", "gpt-oss-20b", "ep4", 4, 8192, 2, "flash", "grouped", "chunked", 113.0, 2),
    Peak(B4, "H200", "qwen2.5-0.5b", "1", 1, 16384, 8, "local", "sequential", "full", 108.3),
    Peak(DP + ", 8192", "H100", "qwen2.5-0.5b", "1", 1, 8192, 16, "local", "sequential", "full", 58.3),
    Peak(DP + ", 4096", "H100", "qwen2.5-0.5b", "1", 1, 4096, 32, "local", "sequential", "full", 33.4),
    *(Peak(R1 + f", {gpus} GPUs", "H200", "qwen3-moe-small", lay, gpus, 16384, 4, "local", "sequential", "full", pk)
      for gpus, lay, pk in [(1, "1", 21.04), (2, "ep2", 20.52), (2, "1", 20.54), (2, "tp2", 10.71), (4, "tp4", 5.55),
                            (4, "tp2 ep2", 10.52), (4, "ep4", 20.38), (4, "1", 20.29)]),
]


def _layout(p: Peak) -> M.Layout:
    kv = {w[:2]: int(w[2:]) for w in p.layout.split() if w != "1"}
    return M.Layout(tp=kv.get("tp", 1), ep=kv.get("ep", 1), world=p.gpus, grad_bytes=p.grad_bytes)


def estimate(p: Peak) -> M.Memory:
    arch, lay = from_hf(MODELS[p.model]), _layout(p)
    seq = 1792 if p.model in ("llama-1b", "gpt-oss slice", "gpt-oss body", "qwen3-30b-a3b body") else 512
    tokens = p.tokens if p.model != "qwen3-moe-small" else min(p.tokens, 16 * 8 * 512 // lay.dp)
    return M.per_gpu(arch, lay, M.Micro(tokens=tokens, seq_len=seq, microbatches=p.microbatches, attention=p.attention,
                                        experts=p.experts, logits=p.logits))


@pytest.mark.parametrize("p", PEAKS, ids=lambda p: f"{p.model}-{p.gpu}-{p.layout}-{p.tokens}-{p.experts}-{p.peak_gib}")
def test_estimate_within_15_percent_of_the_measured_peak(p):
    assert estimate(p).total_bytes / GIB == pytest.approx(p.peak_gib, rel=0.15), p.source


def peaks_table() -> str:
    """The markdown table of docs/megatron.md: every recorded peak beside the model's estimate."""
    out = ["| recorded in | GPU | model | layout (GPUs) | micro-batch tokens | attention, experts, logits "
           "| measured GiB | estimate GiB | error |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in PEAKS:
        e = estimate(p).total_bytes / GIB
        out.append(f"| {p.source} | {p.gpu} | {p.model} | {p.layout} ({p.gpus}) | {p.tokens:,} | {p.attention}, "
                   f"{p.experts}, {p.logits} | {p.peak_gib:g} | {e:.1f} | {e / p.peak_gib - 1:+.1%} |")
    worst = max(PEAKS, key=lambda p: abs(estimate(p).total_bytes / GIB / p.peak_gib - 1))
    err = estimate(worst).total_bytes / GIB / worst.peak_gib - 1
    out.append(f"\nWorst: {err:+.1%} ({worst.model}, {worst.gpu}, {worst.tokens:,} tokens).")
    return "\n".join(out)


def test_docs_carry_the_peaks_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "megatron.md").read_text()
    assert peaks_table() in text


AUTO = [p for p in PEAKS if p.logits == "chunked" and p.gpu == "H100"
        and ("auto" in p.source or p.source == B24)]


@pytest.mark.parametrize("p", AUTO, ids=lambda p: f"{p.model}-{p.experts}")
def test_the_auto_budget_fits_an_h100_with_the_measured_activations(p):
    """The budget `fill` gives on an 80 GB H100 (79.2 GiB; at step 1 the weights, grads and fp32 main params
    are allocated, 1 GiB of context) times each auto row's measured activations per token (its peak less
    the model's states and logit blocks, over its tokens) plus the states and logit blocks stays on the GPU."""
    arch, lay = from_hf(MODELS[p.model]), _layout(p)
    m = estimate(p)
    states = m.param_bytes + m.grad_bytes + m.optimizer_bytes
    logits = M.logit_bytes(arch, lay, M.Micro(tokens=p.tokens, seq_len=1792))
    per_token = (p.peak_gib * GIB - states - logits) / p.tokens
    total = 79.2 * GIB
    free = total - GIB - m.params * (2 + 4 + 4)
    tokens = budget.fill(arch, free_bytes=free, total_bytes=total, optimizer_bytes=8 * m.params, chunk_bytes=GIB,
                         tp=1, pp=1, sequence_parallel=False, experts=p.experts)
    assert states + tokens * per_token + logits < total
