"""config.json fields that inference servers on other transformers versions need spelled out.

transformers 5.17 (the GPU image's) saves a GPT-OSS config without `swiglu_limit`: its modeling code holds the
clamp as a default. SGLang 0.5.14 runs on transformers 5.8.1, whose GptOssConfig has no such default, and reads
`config.swiglu_limit` when it builds the MoE layers (`srt/models/gpt_oss.py`), so its engine died at start on every
version we published (AttributeError, measured on an H200). openai/gpt-oss-20b's own config.json carries
`"swiglu_limit": 7.0`. SGLang also reads `architectures[0]` to pick its model class, which a config built by
`transformers` from a model type holds as None (an AttributeError-free TypeError at its start, H200). `complete` adds
such fields, with the value the model computes with, wherever they are missing; every config.json a weight version
gets goes through it (`weights.formats.config_of`, `WeightStore`)."""

from __future__ import annotations

# model_type -> fields and the value the model uses when its config.json leaves them out
DEFAULTS: dict[str, dict[str, object]] = {
    "gpt_oss": {"swiglu_limit": 7.0},
}


def complete(config: dict) -> dict:
    """`config` (a config.json's content) with its model type's missing `DEFAULTS` filled in (a new dict)."""
    out = dict(config)
    if not out.get("architectures") and out.get("model_type"):  # transformers' causal LM class for the type
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(out["model_type"])
        if name:
            out["architectures"] = [name]
    for key, value in DEFAULTS.get(out.get("model_type", ""), {}).items():
        if out.get(key) is None:
            out[key] = value
    return out
