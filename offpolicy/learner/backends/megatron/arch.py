"""HF config.json -> Megatron-core model description (`Arch`) and its TransformerConfig.

`Arch` is the small, framework-free summary of an HF causal-LM config that both the weight mapping
and the model builder read: sizes, head layout, biases, norms, rope (llama3 or YaRN), attention
features (learned sinks, sliding-window layers), the gated MLP's activation, and for MoE the experts,
top-k, the router's renormalisation and which layers are sparse. `families.from_hf` hands the config
to its family module, which builds the `Arch` or refuses what it does not map with an error naming the
config.json field. `transformer_config` turns an `Arch` plus the parallel layout into a megatron-core
`TransformerConfig` (features, not families: any family with sinks gets `softmax_type="learnable"`);
it imports megatron late, so `Arch` works without it.
Invariant: every number the weight mapping needs (heads, query groups, head dim, vocab, tying) is in
`Arch`, and Megatron's padded vocabulary is `padded_vocab(tp)` (the smallest multiple of `tp`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any


class ArchError(ValueError):
    """An HF config this backend cannot map; the message names the config.json field."""


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling as transformers' `_compute_yarn_parameters` reads `rope_parameters`."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the correction range to integers (HF `truncate`, default true)
    mscale: float | None = None  # with mscale_all_dim: attention factor = mscale(f, mscale) / mscale(f, all_dim)
    mscale_all_dim: float | None = None

    def attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (HF `attention_scaling`, Megatron's concentration factor)."""
        def m(scale: float, k: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

        if self.mscale is None or self.mscale_all_dim is None:
            return m(self.factor)
        return m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim)


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
    expert_fields: tuple[str, str] = ("num_experts", "moe_intermediate_size")  # config.json names, for errors
    linear_bias: bool = False  # every linear but embedding/output has a bias (o_proj, router, experts)
    attn_sinks: bool = False  # a learned logit per head joins every attention softmax (and is dropped after)
    sliding_window: int = 0  # sliding layers attend to keys q - sliding_window + 1 .. q (0 = none)
    window_layers: tuple[bool, ...] = ()  # per layer: True = sliding-window attention
    yarn: Yarn | None = None  # YaRN rope scaling
    glu_alpha: float | None = None  # gate activation g * sigmoid(alpha * g) instead of silu
    glu_limit: float | None = None  # clamp gate to <= limit and up to [-limit, limit] before the GLU
    glu_offset: float = 0.0  # GLU = act(gate) * (up + glu_offset)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def num_params(self) -> int:
        """Parameters of the HF model (tied embeddings counted once)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_query_groups * d
        b = int(self.linear_bias)
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)
        attn += b * h + (self.num_heads if self.attn_sinks else 0)
        dense = 3 * h * f + b * (2 * f + h)
        expert = 3 * h * self.moe_ffn_hidden_size + b * (2 * self.moe_ffn_hidden_size + h)
        moe = self.num_experts * (expert + h + b)  # experts + router
        mlps = sum(moe if self.moe_layers and self.moe_layers[i] else dense for i in range(self.num_layers))
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlps + emb + h


def active_params(arch: Arch) -> int:
    """Parameters a token passes through: `num_params` with each MoE layer's experts counted top-k times."""
    b, i, h = int(arch.linear_bias), arch.moe_ffn_hidden_size, arch.hidden_size
    idle = (arch.num_experts - arch.moe_topk) * (3 * h * i + b * (2 * i + h))
    return arch.num_params() - sum(arch.moe_layers) * idle


def hf_heads(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(heads, query groups, hidden size, head dim) of an HF config; ArchError if heads % groups."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ArchError(f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    return heads, groups, hidden, int(cfg.get("head_dim") or hidden // heads)


def hf_rope_theta(cfg: dict[str, Any], default: float) -> float:
    theta = cfg.get("rope_theta")
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", default)
    return float(theta)


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
    experts, ffn = arch.expert_fields
    if arch.num_experts % ep:
        raise ArchError(f"config.json {experts} {arch.num_experts} is not divisible by megatron.ep {ep}: "
                        "choose an ep dividing it")
    if arch.linear_bias and etp > 1:  # each ETP rank would add the fc2 bias to its partial sum
        raise ArchError(f"megatron.etp {etp}: config.json model_type {arch.model_type} has expert biases, which "
                        "the local expert MLPs add once per ETP rank; set learner.megatron.etp=1")
    if arch.moe_ffn_hidden_size % etp:
        raise ArchError(f"config.json {ffn} {arch.moe_ffn_hidden_size} is not divisible by "
                        f"megatron.etp {etp}: choose an etp dividing it")


def moe_config(arch: Arch, *, ep: int, etp: int, aux_loss_coef: float, dispatcher: str) -> dict[str, Any]:
    """TransformerConfig fields of a MoE `arch` (empty for a dense one).

    Routing equals HF's Qwen3MoeTopKRouter: softmax over all experts then top-k (`moe_router_pre_softmax`)
    when norm_topk_prob is false; with it true, top-k of the logits then a softmax over those k, which is
    the renormalised top-k softmax (and GPT-OSS's router). megatron-core's `moe_grouped_gemm` stays off (it
    needs TE or the grouped_gemm package): the local spec's experts are SequentialMLP, which `model.build`
    replaces by experts.GroupedExperts (learner.megatron.experts); the permutation is unfused (no TE):
    megatron-core's, or permutation.py's gathers (learner.megatron.moe_permute)."""
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


def sigmoid_gate(x, alpha: float):
    """GPT-OSS's gate activation `x * sigmoid(alpha * x)` (transformers GptOssExperts._apply_gate)."""
    import torch

    return x * torch.sigmoid(x * alpha)


def feature_config(arch: Arch) -> dict[str, Any]:
    """TransformerConfig fields of the attention and MLP features (sinks, windows, biases, the GLU)."""
    import torch.nn.functional as F

    out: dict[str, Any] = dict(add_bias_linear=arch.linear_bias, add_qkv_bias=arch.qkv_bias,
                               glu_linear_offset=arch.glu_offset, activation_func_clamp_value=arch.glu_limit,
                               activation_func=F.silu if arch.glu_alpha is None
                               else functools.partial(sigmoid_gate, alpha=arch.glu_alpha))
    if arch.attn_sinks:
        out["softmax_type"] = "learnable"
    if arch.sliding_window:  # Megatron's window (left, right) is inclusive: keys q - left .. q + right
        out.update(window_size=(arch.sliding_window - 1, 0), window_attn_skip_freq=[int(w) for w in arch.window_layers])
    return out


def set_yarn(tconfig, arch: Arch) -> None:
    """YaRN goes to megatron-core 0.16-0.19 as attributes of the config object, which GPTModel (its
    YarnRotaryEmbedding) and the attention (the concentration factor on cos/sin) read with getattr."""
    y = arch.yarn
    if y is None:
        return
    tconfig.yarn_rotary_scaling_factor = y.factor
    tconfig.yarn_original_max_position_embeddings = y.original_max_positions
    tconfig.yarn_beta_fast, tconfig.yarn_beta_slow = y.beta_fast, y.beta_slow
    tconfig.yarn_mscale, tconfig.yarn_mscale_all_dim = y.mscale, y.mscale_all_dim
    tconfig.yarn_correction_range_round_to_int = y.truncate


def rope_kwargs(arch: Arch) -> dict[str, Any]:
    """GPTModel's position-embedding arguments of `arch`."""
    if arch.yarn is not None:
        return dict(position_embedding_type="yarn", rotary_base=arch.rope_theta)
    out: dict[str, Any] = dict(position_embedding_type="rope", rotary_base=arch.rope_theta,
                               rope_scaling=arch.llama3_rope_factor is not None)
    if arch.llama3_rope_factor is not None:
        out["rope_scaling_factor"] = arch.llama3_rope_factor
    return out


def transformer_config(arch: Arch, *, tp: int, pp: int, sequence_parallel: bool, dtype, recompute: str,
                       recompute_layers: int, ep: int = 1, etp: int = 1, moe_aux_loss_coef: float = 0.0,
                       moe_dispatcher: str = "alltoall", fused: bool = False, swiglu_module: bool = False):
    """The megatron-core TransformerConfig of `arch` under this layout (imports megatron).

    `fused` turns on megatron-core's SwiGLU fusion (`bias_activation_fusion`: one torch.compile'd kernel
    each way, and only the fc1 output kept for the backward); the learner sets it on a GPU. `swiglu_module`
    (the learner's, on a GPU with the local spec) runs a dense family's plain SwiGLU as glu.SwiGLU instead
    (`use_te_activation_func`, which model.build honours with the module in the spec; MoE families unchanged)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    check_layout(arch, tp, pp, ep, etp)
    extra: dict[str, Any] = moe_config(arch, ep=ep, etp=etp, aux_loss_coef=moe_aux_loss_coef,
                                       dispatcher=moe_dispatcher)
    extra.update(feature_config(arch))
    plain_glu = arch.glu_alpha is None and arch.glu_limit is None and not arch.glu_offset
    if swiglu_module and plain_glu and not arch.is_moe:
        extra["use_te_activation_func"] = True
        fused = False
    if not arch.is_moe:
        extra["moe_token_dispatcher_type"] = "alltoall"
    if recompute == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_layers)
    elif recompute == "selective":
        extra.update(recompute_granularity="selective")
    # perform_initialization must stay on: Megatron marks tensor-parallel weights (the attribute its grad
    # norm and optimizer read) only while initialising them; `model.load` overwrites the values, so the
    # init methods draw nothing (`loaded_later`: no random draws over the whole model at start-up).
    import dataclasses

    skip = {f.name: loaded_later for f in dataclasses.fields(TransformerConfig)
            if f.name in ("init_method", "output_layer_init_method", "embedding_init_method")}
    tconfig = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_eps, gated_linear_unit=True,
        qk_layernorm=arch.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=fused and arch.glu_alpha is None and arch.glu_limit is None,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, perform_initialization=True,
        use_cpu_initialization=False, calculate_per_token_loss=True, variable_seq_lengths=pp > 1,
        deallocate_pipeline_outputs=False, **skip, **extra,
    )
    set_yarn(tconfig, arch)
    return tconfig


def loaded_later(weight):
    """Megatron's init method for weights that `model.load` fills: leaves them as allocated (and returns
    them, as torch's init functions do: DotProductAttention keeps what its init method returns)."""
    return weight
