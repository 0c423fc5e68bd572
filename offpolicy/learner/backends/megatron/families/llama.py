"""The Llama family of the Megatron backend: Llama, Qwen2, Qwen3 (dense) and Qwen3-MoE.

`from_hf` reads their config.json fields into an `arch.Arch` (qkv bias for Qwen2 or `attention_bias`,
qk-norm for Qwen3, llama3 rope scaling, and Qwen3-MoE's experts as transformers'
Qwen3MoeDecoderLayer reads them: no shared experts); it refuses sliding windows, other rope scalings
and activations with an error naming the field. `layer_params` lists one decoder layer's parameters:
QKV, output projection, norms, and the dense MLP or the MoE block (router `mlp.gate.weight`, experts
in the checkpoint's per-expert names `mlp.experts.<e>.gate_proj.weight`). Checkpoints name every
tensor the mapping reads, so the family keeps the default reader and export.
"""

from __future__ import annotations

from typing import Any

from offpolicy.learner.backends.megatron.arch import Arch, ArchError, hf_heads, hf_rope_theta
from offpolicy.learner.backends.megatron.families.base import Family
from offpolicy.learner.backends.megatron.mapping import Param, attention_params, expert_params


class Llama(Family):
    model_types = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                   "qwen3_moe": "Qwen3MoeForCausalLM"}

    def from_hf(self, cfg: dict[str, Any]) -> Arch:
        mt = cfg["model_type"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ArchError(f"config.json hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU) is mapped")
        if cfg.get("use_sliding_window"):
            raise ArchError("config.json use_sliding_window is true: sliding-window attention is not mapped for "
                            f"{mt}; set it to false")
        scaling = cfg.get("rope_scaling") or None
        factor = None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                factor = float(scaling["factor"])
            elif kind != "default":
                raise ArchError(f"config.json rope_scaling type {kind!r} is not mapped for {mt}: only llama3 is")
        heads, groups, hidden, head_dim = hf_heads(cfg)
        moe = _moe_fields(cfg, int(cfg["num_hidden_layers"])) if mt == "qwen3_moe" else {}
        return Arch(
            model_type=mt, num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden,
            ffn_hidden_size=int(cfg["intermediate_size"]), num_heads=heads, num_query_groups=groups,
            head_dim=head_dim, vocab_size=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings", 4096)), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=hf_rope_theta(cfg, 10000.0), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=mt in ("qwen3", "qwen3_moe"),
            llama3_rope_factor=factor, **moe,
        )

    def layer_params(self, arch: Arch, i: int, j: int, *, ep: int, te: bool, grouped: bool = True) -> list[Param]:
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
        moe = arch.is_moe and arch.moe_layers[i]
        out = attention_params(arch, hf, mg, te=te, mlp_norm_fused=te and not moe)
        if moe:
            return out + _moe_params(arch, hf + "mlp.", mg + "mlp.", ep, grouped)
        out.append(Param(mg + "mlp.linear_fc1.weight", "fc1", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")))
        out.append(Param(mg + "mlp.linear_fc2.weight", "row", (hf + "mlp.down_proj.weight",)))
        return out


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


def _moe_params(arch: Arch, hf: str, mg: str, ep: int, grouped: bool) -> list[Param]:
    pieces = [("linear_fc1.weight", "fc1", ("gate_proj.weight", "up_proj.weight")),
              ("linear_fc2.weight", "row", ("down_proj.weight",))]
    return [Param(mg + "router.weight", "rep", (hf + "gate.weight",)),
            *expert_params(arch, ep, hf + "experts.", mg + "experts.", pieces, grouped=grouped)]


FAMILY = Llama()
