"""HF config.json -> Megatron-core model description, for the Llama, Qwen2 and Qwen3 dense families.

`Arch` is the small, framework-free summary of an HF causal-LM config that both the weight mapping
and the model builder read: sizes, head layout, biases, norms, rope. `from_hf` refuses what the
mapping does not cover (MoE, sliding windows, rope scaling other than llama3) with an error naming
the config.json field. `transformer_config` turns an `Arch` plus the parallel layout into a
megatron-core `TransformerConfig`; it imports megatron late, so `Arch` works without it.
Invariant: every number the weight mapping needs (heads, query groups, head dim, vocab, tying) is in
`Arch`, and Megatron's padded vocabulary is `padded_vocab(tp)` (the smallest multiple of `tp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ArchError(ValueError):
    """An HF config this backend cannot map; the message names the config.json field."""


@dataclass(frozen=True)
class Arch:
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    llama3_rope_factor: float | None  # rope_scaling of rope_type llama3 (Llama 3.1+), else None

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def num_params(self) -> int:
        """Parameters of the HF model (tied embeddings counted once)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h


def from_hf(cfg: dict[str, Any]) -> Arch:
    """The `Arch` of an HF config.json mapping; raises ArchError for what is not supported."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise ArchError(f"config.json model_type {mt!r} is not supported by learner.backend=megatron: "
                        f"use one of {sorted(FAMILIES)} or learner.backend=torch")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ArchError(f"config.json hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU) is mapped")
    if cfg.get("use_sliding_window"):
        raise ArchError("config.json use_sliding_window is true: sliding-window attention is not mapped; "
                        "set it to false")
    scaling = cfg.get("rope_scaling") or None
    factor = None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            factor = None
        elif kind == "llama3":
            factor = float(scaling["factor"])
        else:
            raise ArchError(f"config.json rope_scaling type {kind!r} is not mapped: only llama3 is")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    theta = cfg.get("rope_theta")
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ArchError(f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    return Arch(
        model_type=mt, num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]), num_heads=heads, num_query_groups=groups,
        head_dim=int(head_dim), vocab_size=int(cfg["vocab_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 4096)), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=mt == "qwen3",
        llama3_rope_factor=factor,
    )


def check_layout(arch: Arch, tp: int, pp: int) -> None:
    """Raise ArchError if the model cannot be split `tp` x `pp` ways."""
    for what, n in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_query_groups),
                    ("intermediate_size", arch.ffn_hidden_size)):
        if n % tp:
            raise ArchError(f"config.json {what} {n} is not divisible by megatron.tp {tp}: choose a tp dividing it")
    if arch.num_layers % pp:
        raise ArchError(f"config.json num_hidden_layers {arch.num_layers} is not divisible by megatron.pp {pp}: "
                        "choose a pp dividing it")


def transformer_config(arch: Arch, *, tp: int, pp: int, sequence_parallel: bool, dtype, recompute: str,
                       recompute_layers: int):
    """The megatron-core TransformerConfig of `arch` under this layout (imports megatron)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_layout(arch, tp, pp)
    extra: dict[str, Any] = {}
    if recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=recompute_layers)
    elif recompute == "selective":
        extra = dict(recompute_granularity="selective")
    # perform_initialization must stay on: Megatron marks tensor-parallel weights (the attribute its grad
    # norm and optimizer read) only while initialising them; `model.load` overwrites the values.
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, perform_initialization=True,
        use_cpu_initialization=False, calculate_per_token_loss=True, variable_seq_lengths=pp > 1,
        deallocate_pipeline_outputs=False, moe_token_dispatcher_type="alltoall", **extra,
    )
