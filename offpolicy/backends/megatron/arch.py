"""HF config.json -> Megatron-core model description: dense Llama/Qwen2/Qwen3 and Qwen3-MoE.

`Arch` is the small, framework-free summary of an HF causal-LM config that both the weight mapping
and the model builder read: sizes, head layout, biases, norms, rope, and for MoE the experts, top-k,
the router's renormalisation and which layers are sparse. `from_hf` refuses what the mapping does not
cover (other MoE families, sliding windows, rope scaling other than llama3) with an error naming
the config.json field. `transformer_config` turns an `Arch` plus the parallel layout into a
megatron-core `TransformerConfig`; it imports megatron late, so `Arch` works without it.
Invariant: every number the weight mapping needs (heads, query groups, head dim, vocab, tying) is in
`Arch`, and Megatron's padded vocabulary is `padded_vocab(tp)` (the smallest multiple of `tp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}


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
    num_experts: int = 0  # routed experts per MoE layer (0 = dense model)
    moe_topk: int = 0  # experts per token (num_experts_per_tok)
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size (moe_intermediate_size)
    moe_norm_topk: bool = True  # renormalise the top-k softmax probabilities to sum 1 (norm_topk_prob)
    moe_layers: tuple[bool, ...] = ()  # per layer: True = MoE block, False = dense MLP (intermediate_size)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def num_params(self) -> int:
        """Parameters of the HF model (tied embeddings counted once)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)
        dense = 3 * h * f
        moe = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h)  # experts + router
        mlps = sum(moe if self.moe_layers and self.moe_layers[i] else dense for i in range(self.num_layers))
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlps + emb + h


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
    moe = _moe_fields(cfg, int(cfg["num_hidden_layers"])) if mt == "qwen3_moe" else {}
    return Arch(
        model_type=mt, num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]), num_heads=heads, num_query_groups=groups,
        head_dim=int(head_dim), vocab_size=int(cfg["vocab_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 4096)), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=mt in ("qwen3", "qwen3_moe"),
        llama3_rope_factor=factor, **moe,
    )


def _moe_fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert fields, as transformers' Qwen3MoeDecoderLayer reads them (no shared experts)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes num_local_experts
    if not experts or int(experts) < 1:
        raise ArchError("config.json num_experts is missing or 0: a dense Qwen3 is model_type qwen3")
    experts, topk = int(experts), int(cfg.get("num_experts_per_tok", 8))
    if not 1 <= topk <= experts:
        raise ArchError(f"config.json num_experts_per_tok {topk} must be in [1, num_experts={experts}]")
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
    if step < 1:
        raise ArchError(f"config.json decoder_sparse_step {step} must be >= 1")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    if not any(sparse):
        raise ArchError("config.json decoder_sparse_step / mlp_only_layers leave no MoE layer: "
                        "use model_type qwen3 for a dense model")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_norm_topk=bool(cfg.get("norm_topk_prob", False)), moe_layers=sparse)


def check_layout(arch: Arch, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
    """Raise ArchError if the model cannot be split `tp` x `pp` (x `ep` x `etp` for experts) ways."""
    sizes = [("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_query_groups)]
    if not arch.is_moe or not all(arch.moe_layers):  # dense MLP layers
        sizes.append(("intermediate_size", arch.ffn_hidden_size))
    for what, n in sizes:
        if n % tp:
            raise ArchError(f"config.json {what} {n} is not divisible by megatron.tp {tp}: choose a tp dividing it")
    if arch.num_layers % pp:
        raise ArchError(f"config.json num_hidden_layers {arch.num_layers} is not divisible by megatron.pp {pp}: "
                        "choose a pp dividing it")
    if not arch.is_moe:
        if ep > 1 or etp > 1:
            raise ArchError(f"megatron.ep/etp are {ep}/{etp} but config.json model_type {arch.model_type} is dense: "
                            "set learner.megatron.ep=1 and etp=1")
        return
    if arch.num_experts % ep:
        raise ArchError(f"config.json num_experts {arch.num_experts} is not divisible by megatron.ep {ep}: "
                        "choose an ep dividing it")
    if arch.moe_ffn_hidden_size % etp:
        raise ArchError(f"config.json moe_intermediate_size {arch.moe_ffn_hidden_size} is not divisible by "
                        f"megatron.etp {etp}: choose an etp dividing it")


def moe_config(arch: Arch, *, ep: int, etp: int, aux_loss_coef: float, dispatcher: str) -> dict[str, Any]:
    """TransformerConfig fields of a MoE `arch` (empty for a dense one).

    Routing equals HF's Qwen3MoeTopKRouter: softmax over all experts then top-k (`moe_router_pre_softmax`)
    when norm_topk_prob is false; with it true, top-k of the logits then a softmax over those k, which is
    the renormalised top-k softmax. Experts are SequentialMLP (`moe_grouped_gemm` off: grouped GEMM needs
    TE or the grouped_gemm package); the permutation is unfused (no TE)."""
    if not arch.is_moe:
        return {}
    return dict(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layer_freq=[int(m) for m in arch.moe_layers], moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.moe_norm_topk, moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coef, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )


def transformer_config(arch: Arch, *, tp: int, pp: int, sequence_parallel: bool, dtype, recompute: str,
                       recompute_layers: int, ep: int = 1, etp: int = 1, moe_aux_loss_coef: float = 0.0,
                       moe_dispatcher: str = "alltoall", fused: bool = False):
    """The megatron-core TransformerConfig of `arch` under this layout (imports megatron).

    `fused` turns on megatron-core's SwiGLU fusion (`bias_activation_fusion`: one torch.compile'd kernel
    each way, and only the fc1 output kept for the backward); the learner sets it on a GPU."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_layout(arch, tp, pp, ep, etp)
    extra: dict[str, Any] = moe_config(arch, ep=ep, etp=etp, aux_loss_coef=moe_aux_loss_coef,
                                       dispatcher=moe_dispatcher)
    if not arch.is_moe:
        extra["moe_token_dispatcher_type"] = "alltoall"
    if recompute == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_layers)
    elif recompute == "selective":
        extra.update(recompute_granularity="selective")
    # perform_initialization must stay on: Megatron marks tensor-parallel weights (the attribute its grad
    # norm and optimizer read) only while initialising them; `model.load` overwrites the values.
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=fused, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, perform_initialization=True,
        use_cpu_initialization=False, calculate_per_token_loss=True, variable_seq_lengths=pp > 1,
        deallocate_pipeline_outputs=False, **extra,
    )
