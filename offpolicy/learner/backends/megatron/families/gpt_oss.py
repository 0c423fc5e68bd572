"""The GPT-OSS family of the Megatron backend (transformers' GptOssForCausalLM), exact to its forward.

Architecture (transformers models/gpt_oss/modeling_gpt_oss.py) -> `arch.Arch` features -> Megatron:
- attention: q/k/v/o biases (`attention_bias`, required), GQA, `head_dim`, a learned sink logit per
  head (`self_attn.sinks`) -> DotProductAttention's `softmax_type="learnable"` offset, which joins the
  softmax as one more column and is dropped after it, as HF's eager attention does;
- `layer_types` / `sliding_window`: a sliding layer's query at q sees keys q - W + 1 .. q (HF:
  kv > q - W) -> Megatron `window_size=(W - 1, 0)` (inclusive) on the layers `window_attn_skip_freq`
  marks (a per-layer list, global layer numbers, so PP keeps the pattern);
- YaRN rope (`rope_parameters` or the older `rope_scaling`: factor, original_max_position_embeddings,
  beta_fast, beta_slow, truncate; attention factor 0.1 ln(factor) + 1 on cos and sin) -> Megatron's
  YarnRotaryEmbedding (`arch.set_yarn`);
- MoE in every layer: router with bias, top-k of the logits then a softmax over those k
  (`moe_router_pre_softmax=false`); experts with biases and the clamped SwiGLU
  (gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)) -> `glu_linear_offset=1`,
  `activation_func_clamp_value=limit`, activation `arch.sigmoid_gate`; RMSNorm.
Checkpoint layout: a layer's experts are fused, `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved in the last dimension (gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I]
alike, `down_proj` [E, I, H], `down_proj_bias` [E, H] (x @ W, not W x). `reader` serves the mapping
per-expert names (`mlp.experts.<e>.gate_proj.weight` = gate_up_proj[e][:, ::2].T, ...); `export`
fuses them back on rank 0 and yields each fused tensor once all E experts of it arrived; `export_pieces`
(the sharded publish) turns one parameter's experts into their rows of the fused tensors instead
(consecutive experts in one piece; gate and up interleaved in the last dimension, the weights transposed).
Invariant: export(per-expert pieces of reader(ckpt)) == ckpt, bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from offpolicy.learner.backends.megatron.arch import Arch, ArchError, Yarn, hf_heads, hf_rope_theta
from offpolicy.learner.backends.megatron.families.base import Family
from offpolicy.learner.backends.megatron.mapping import Param, attention_params, expert_params

# one expert's pieces: (Megatron suffix, mapping kind, HF names the reader serves)
_PIECES = [("linear_fc1.weight", "fc1", ("gate_proj.weight", "up_proj.weight")),
           ("linear_fc1.bias", "fc1", ("gate_proj.bias", "up_proj.bias")),
           ("linear_fc2.weight", "row", ("down_proj.weight",)), ("linear_fc2.bias", "rep", ("down_proj.bias",))]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


class GptOss(Family):
    model_types = {"gpt_oss": "GptOssForCausalLM"}
    te = False  # the TE spec (fused sinks, window) has not run: GPT-OSS builds the local spec

    def from_hf(self, cfg: dict[str, Any]) -> Arch:
        if not cfg.get("attention_bias", True):
            raise ArchError("config.json attention_bias is false: GPT-OSS is mapped with q/k/v/o biases only "
                            "(its router and experts always have them)")
        layers = int(cfg["num_hidden_layers"])
        heads, groups, hidden, head_dim = hf_heads(cfg)
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(layers)]
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ArchError(f"config.json layer_types {types!r}: give num_hidden_layers={layers} entries, each "
                            "sliding_attention or full_attention")
        windows = tuple(t == "sliding_attention" for t in types)
        window = int(cfg.get("sliding_window") or 0)
        if any(windows) and window < 1:
            raise ArchError("config.json sliding_window is missing but layer_types has sliding_attention layers: "
                            "set sliding_window")
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        topk = int(cfg.get("num_experts_per_tok", 4))
        if not 1 <= topk <= experts:
            raise ArchError(f"config.json num_experts_per_tok {topk} must be in [1, num_local_experts={experts}]")
        ffn = int(cfg["intermediate_size"])
        max_pos = int(cfg.get("max_position_embeddings", 131072))
        return Arch(
            model_type="gpt_oss", num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_heads=heads,
            num_query_groups=groups, head_dim=head_dim, vocab_size=int(cfg["vocab_size"]), max_positions=max_pos,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=hf_rope_theta(cfg, 150000.0),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=True, qk_norm=False,
            llama3_rope_factor=None, num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=ffn, moe_norm_topk=True,
            moe_layers=(True,) * layers, expert_fields=("num_local_experts", "intermediate_size"), linear_bias=True,
            attn_sinks=True, sliding_window=window if any(windows) else 0, window_layers=windows if any(windows) else (),
            yarn=_yarn(cfg, max_pos), glu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            glu_limit=float(cfg.get("swiglu_limit", 7.0)), glu_offset=1.0,
        )

    def layer_params(self, arch: Arch, i: int, j: int, *, ep: int, te: bool, grouped: bool = True) -> list[Param]:
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
        out = attention_params(arch, hf, mg, te=te, mlp_norm_fused=False)
        out += [Param(f"{mg}mlp.router.{k}", "rep", (f"{hf}mlp.router.{k}",)) for k in ("weight", "bias")]
        return out + expert_params(arch, ep, f"{hf}mlp.experts.", f"{mg}mlp.experts.", _PIECES, grouped=grouped)

    def reader(self, arch: Arch, source):
        def get(name: str) -> torch.Tensor:
            m = _EXPERT.match(name)
            if m is None:
                return source.get(name)
            base, e, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            fused = source.get(f"{base}.{_fused(proj, kind)}", row=e)  # this expert's slice only
            if proj == "down":
                return fused.T if kind == "weight" else fused
            half = fused[..., 0::2] if proj == "gate" else fused[..., 1::2]
            return half.T if kind == "weight" else half

        return get

    def export(self, arch: Arch, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, tuple[torch.Tensor, set[tuple[int, str]]]] = {}
        for name, t in tensors:
            m = _EXPERT.match(name)
            if m is None:
                yield name, t
                continue
            base, e, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            key = f"{base}.{_fused(proj, kind)}"
            if key not in pending:
                pending[key] = (_empty_fused(arch, proj, kind, t), set())
            buf, seen = pending[key]
            if proj == "down":
                buf[e] = t.T if kind == "weight" else t
            else:
                half = buf[e, ..., 0::2] if proj == "gate" else buf[e, ..., 1::2]
                half.copy_(t.T if kind == "weight" else t)
            seen.add((e, proj))
            if len(seen) == arch.num_experts * (1 if proj == "down" else 2):
                yield key, pending.pop(key)[0]
        if pending:
            raise RuntimeError(f"experts missing from the gathered weights of {sorted(pending)}")

    def as_is(self, name: str) -> bool:
        return _EXPERT.match(name) is None  # the experts are fused into gate_up_proj / down_proj

    def export_pieces(self, arch: Arch, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, int | None, torch.Tensor]]:
        out: list[tuple[str, int | None, torch.Tensor]] = []
        rows: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # fused name -> expert -> proj -> tensor
        for name, t in tensors:
            m = _EXPERT.match(name)
            if m is None:
                out.append((name, None, t))
                continue
            base, e, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            rows.setdefault(f"{base}.{_fused(proj, kind)}", {}).setdefault(e, {})[proj] = t.T if kind == "weight" else t
        for key, experts in rows.items():
            first = min(experts)
            if sorted(experts) != list(range(first, first + len(experts))):
                raise RuntimeError(f"{key}: the experts of one parameter are not consecutive ({sorted(experts)})")
            stacked = []
            for e in range(first, first + len(experts)):
                parts = experts[e]
                if "down" in parts:
                    stacked.append(parts["down"])
                    continue
                if set(parts) != {"gate", "up"}:
                    raise RuntimeError(f"{key}: expert {e} has {sorted(parts)}, not gate and up")
                row = parts["gate"].new_empty((*parts["gate"].shape[:-1], 2 * parts["gate"].shape[-1]))
                row[..., 0::2], row[..., 1::2] = parts["gate"], parts["up"]
                stacked.append(row)
            out.append((key, first, torch.stack(stacked)))
        return out


def _fused(proj: str, kind: str) -> str:
    """The checkpoint name (after `mlp.experts.`) holding expert piece `proj`/`kind`."""
    return ("down_proj" if proj == "down" else "gate_up_proj") + ("_bias" if kind == "bias" else "")


def _empty_fused(arch: Arch, proj: str, kind: str, like: torch.Tensor) -> torch.Tensor:
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_ffn_hidden_size
    shape = {("down", "weight"): (e, i, h), ("down", "bias"): (e, h)}.get(
        (proj, kind), (e, h, 2 * i) if kind == "weight" else (e, 2 * i))
    return like.new_empty(shape)


def _yarn(cfg: dict[str, Any], max_pos: int) -> Yarn | None:
    """YaRN as transformers' _compute_yarn_parameters reads it (None for default rope)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ArchError(f"config.json rope_parameters rope_type {kind!r} is not mapped for gpt_oss: only yarn "
                        "(or default) is")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ArchError("config.json rope_parameters partial_rotary_factor != 1 is not mapped: remove it")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    y = Yarn(factor=float(factor) if factor is not None else max_pos / original, original_max_positions=original,
             beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
             truncate=bool(rope.get("truncate", True)),
             mscale=float(mscale) if mscale and all_dim else None, mscale_all_dim=float(all_dim) if mscale and all_dim else None)
    given = rope.get("attention_factor")
    if given is not None and float(given) != y.attention_factor():
        raise ArchError(f"config.json rope_parameters attention_factor {given} differs from YaRN's own "
                        f"{y.attention_factor()}: Megatron cannot set it; remove it")
    return y


FAMILY = GptOss()
