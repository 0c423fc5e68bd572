"""Model shapes for the planner: parameters by part, active parameters, FLOPs and KV bytes per token.

`Shape` wraps the Megatron backend's `Arch` (`families.from_hf`; its `num_params` and `active_params` are the
project's parameter counts of an HF config) and adds what planning needs beyond them: how the
parameters split into routed experts (sharded over EP) and the rest (sharded over TP; embeddings over
the vocabulary), and the KV cache, bounded by the window on sliding-window layers. Presets are HF
config.json fields written out, no download. Invariant: dense_params + expert_params == arch.num_params().
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from offpolicy.learner.backends.megatron.arch import Arch, ArchError, active_params
from offpolicy.learner.backends.megatron.memory import GPT_OSS_120B, GPT_OSS_20B

PRESETS: dict[str, dict] = {
    # openai/gpt-oss-20b and -120b config.json (offpolicy/learner/backends/megatron/memory.py writes them out)
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
    # Qwen/Qwen2.5-0.5B config.json (benchmarks/megatron_learner.py's QWEN25_05B)
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    # the rollout and pipeline benchmarks' model (offpolicy/bench/rollout.py defaults, heads of 64)
    "bench-llama-110m": dict(model_type="llama", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                             num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                             max_position_embeddings=4096, tie_word_embeddings=True),
    # tests/megatron_workers.py QWEN3_MOE_SMALL (benchmarks/megatron_layouts.py's default)
    "qwen3-moe-small": dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                            moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            max_position_embeddings=4096, tie_word_embeddings=False),
    # configs/quickstart.yaml model.arch
    "quickstart": dict(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Shape:
    name: str
    arch: Arch

    @property
    def sliding_window(self) -> int:
        return self.arch.sliding_window

    @property
    def sliding_layers(self) -> int:
        """Layers whose attention (and KV cache) the window bounds."""
        return sum(self.arch.window_layers) if self.arch.sliding_window else 0

    @property
    def params(self) -> int:
        return self.arch.num_params()

    @property
    def moe_layers(self) -> int:
        return sum(self.arch.moe_layers) if self.arch.is_moe else 0

    @property
    def expert_params(self) -> int:
        """Routed expert weights (gate, up, down and their biases, every expert): what EP splits."""
        a = self.arch
        i, h, b = a.moe_ffn_hidden_size, a.hidden_size, int(a.linear_bias)
        return self.moe_layers * a.num_experts * (3 * h * i + b * (2 * i + h))

    @property
    def dense_params(self) -> int:
        """Everything else: attention, norms, routers, dense MLPs, embeddings (TP splits these)."""
        return self.params - self.expert_params

    @property
    def embedding_params(self) -> int:
        a = self.arch
        return a.vocab_size * a.hidden_size * (1 if a.tie_embeddings else 2)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (top-k experts of each MoE layer)."""
        return active_params(self.arch)

    @property
    def full_layers(self) -> int:
        return self.arch.num_layers - self.sliding_layers

    def attention_span(self, seq: float) -> float:
        """Mean tokens attended per layer at sequence length `seq` (sliding layers are capped)."""
        w = min(seq, self.sliding_window) if self.sliding_layers else seq
        return (self.full_layers * seq + self.sliding_layers * w) / self.arch.num_layers

    def train_flops_per_token(self, seq: float) -> float:
        """Forward + backward FLOPs per token: 6 x active params + 12 x layers x heads x head_dim x span,
        the definition benchmarks/megatron_learner.py computes its measured MFU with (no causal halving)."""
        a = self.arch
        return 6 * self.active_params + 12 * a.num_layers * a.num_heads * a.head_dim * self.attention_span(seq)

    def kv_bytes_per_token_layer(self, dtype_bytes: int = 2) -> int:
        """K and V of one token in one layer."""
        return 2 * self.arch.num_query_groups * self.arch.head_dim * dtype_bytes

    def kv_bytes(self, context: float, dtype_bytes: int = 2) -> float:
        """KV cache bytes of one sequence of `context` tokens (sliding layers keep only the window)."""
        per = self.kv_bytes_per_token_layer(dtype_bytes)
        window = min(context, self.sliding_window) if self.sliding_layers else context
        return per * (self.full_layers * context + self.sliding_layers * window)

    def weight_bytes(self, expert_bits: float = 16.0) -> float:
        """Bytes of one copy of the weights: bf16, with experts at `expert_bits` (4.25 = MXFP4 with scales)."""
        return 2 * self.dense_params + self.expert_params * expert_bits / 8

    def version_bytes(self) -> int:
        """One published weight version: bf16 HF tensors of every parameter."""
        return 2 * self.params


def from_config(name: str, cfg: dict) -> Shape:
    """The Shape of an HF config.json mapping (the families `from_hf` maps)."""
    from offpolicy.learner.backends.megatron.families import from_hf  # late: the family modules import torch

    return Shape(name, from_hf(cfg))


def load_shape(spec: str) -> Shape:
    """A preset name (PRESETS), or an HF config.json file, or a model directory holding one."""
    if spec in PRESETS:
        return from_config(spec, PRESETS[spec])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ArchError(f"--model {spec!r}: not a preset ({', '.join(PRESETS)}) nor an HF config.json file or "
                        "a model directory holding one")
    return from_config(path.parent.name if path.name == "config.json" else path.stem, json.loads(path.read_text()))
