"""`weights.convert`: a native checkpoint written again in fp8 or MXFP4 holds what a published version of the
same weights holds, bit for bit, and what vLLM's launch needs (`rollout.engines.launch.initial_model`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from offpolicy.config import load_config
from offpolicy.models.build import build_model
from offpolicy.rollout.engines.launch import initial_model
from offpolicy.weights.convert import convert
from offpolicy.weights.formats import checkpoint_format, encode
from tests.conftest import ROOT

TINY_GPT_OSS = ["model.dtype=bfloat16", "model.arch.head_dim=64"]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The tiny GPT-OSS of configs/gptoss-tiny.yaml saved by transformers, in two shards."""
    cfg = load_config(ROOT / "configs" / "gptoss-tiny.yaml", TINY_GPT_OSS)
    out = tmp_path_factory.mktemp("native") / "model"
    build_model(cfg.model, torch.device("cpu")).save_pretrained(out, max_shard_size="200KB")
    return cfg, out


def tensors(path):
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_a_converted_checkpoint_is_the_publishers_encoding_bit_for_bit(native, tmp_path, fmt):
    cfg, src = native
    assert len(list(src.glob("*.safetensors"))) > 1  # shard by shard
    out = convert(src, tmp_path / fmt, fmt, (64, 64))
    want, want_config = encode(fmt, sorted(tensors(src).items()), json.loads((src / "config.json").read_text()),
                               (64, 64))
    got = tensors(out)
    assert set(got) == {n for n, _ in want}
    for name, t in want:
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == want_config["quantization_config"] and checkpoint_format(out) == fmt
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert (out / "generation_config.json").exists() == (src / "generation_config.json").exists()
    if fmt == "fp8":  # the 3-D experts stay bf16 and are named as kept
        assert "model.layers.0.mlp.experts" in config["quantization_config"]["ignored_layers"]
        assert got["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    with pytest.raises(FileExistsError, match="exists"):
        convert(src, out, fmt)
    with pytest.raises(ValueError, match="must be native"):
        convert(out, tmp_path / "again", fmt)


def test_vllm_starts_from_a_checkpoint_in_its_versions_format(native, tmp_path):
    """initial_model: model.path as it is for native versions; converted once into the run dir for low-bit ones;
    a low-bit model.path with versions of another format is refused, naming the fields and the fix."""
    cfg, src = native
    path = [f"model.path={src}", *TINY_GPT_OSS]
    assert initial_model(load_config(ROOT / "configs" / "gptoss-tiny.yaml", path), tmp_path) == str(src)
    low = load_config(ROOT / "configs" / "gptoss-tiny.yaml",
                      [*path, "weights.formats=[mxfp4]", "rollout.weights_format=mxfp4"])
    out = initial_model(low, tmp_path)
    assert out == str(tmp_path / "vllm-initial-model-mxfp4") and checkpoint_format(out) == "mxfp4"
    assert initial_model(low, tmp_path) == out  # made once
    built = load_config(ROOT / "configs" / "gptoss-tiny.yaml", [*TINY_GPT_OSS, "weights.formats=[fp8]",
                                                                  "rollout.weights_format=fp8"])
    made = initial_model(built, tmp_path / "run")  # model.arch: built, saved, converted
    assert checkpoint_format(tmp_path / "run" / "vllm-initial-model") == "native" and checkpoint_format(made) == "fp8"
    for fmt in ("native", "fp8"):
        wrong = load_config(ROOT / "configs" / "gptoss-tiny.yaml",
                            [f"model.path={out}", *TINY_GPT_OSS, "weights.formats=[fp8]", f"rollout.weights_format={fmt}"])
        with pytest.raises(ValueError, match=f"is a mxfp4 checkpoint, but rollout.weights_format={fmt}"):
            initial_model(wrong, tmp_path / fmt)


def test_vllm_gets_a_gpt_oss_fp8_checkpoint_in_blocks_it_serves(native, tmp_path):
    """fp8 for vLLM: weights.fp8_block_size auto converts the GPT-OSS launch checkpoint in 64 x 64 blocks (its
    hidden size, here 64 as 2880 in the real model, is no multiple of 128), experts, router, embeddings and
    lm_head named in ignored_layers; a 128 block is refused before anything is converted or launched."""
    cfg, src = native
    fp8 = [f"model.path={src}", *TINY_GPT_OSS, "weights.formats=[fp8]", "rollout.weights_format=fp8",
           "rollout.engine=vllm"]
    with pytest.raises(ValueError, match=r"weights.fp8_block_size=\[128, 128\] cannot be served by "
                                         r"rollout.engine=vllm at TP 1.*input 64 is not a multiple of 128.*"
                                         r"Set weights.fp8_block_size=\[64, 64\]"):
        initial_model(load_config(ROOT / "configs" / "gptoss-tiny.yaml", [*fp8, "weights.fp8_block_size=[128, 128]"]),
                      tmp_path / "refused")
    assert not (tmp_path / "refused" / "vllm-initial-model-fp8").exists()
    out = initial_model(load_config(ROOT / "configs" / "gptoss-tiny.yaml", fp8), tmp_path)
    qc = json.loads((tmp_path / "vllm-initial-model-fp8" / "config.json").read_text())["quantization_config"]
    assert out == str(tmp_path / "vllm-initial-model-fp8")
    assert qc["weight_block_size"] == [64, 64] and qc["activation_scheme"] == "dynamic" and qc["quant_method"] == "fp8"
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        assert {p + "mlp.experts", p + "mlp.router"} <= set(qc["ignored_layers"])
        assert not any("self_attn" in m for m in qc["ignored_layers"])
    assert {"model.embed_tokens", "lm_head"} <= set(qc["ignored_layers"])
    assert qc["modules_to_not_convert"] == qc["ignored_layers"]
    got = tensors(tmp_path / "vllm-initial-model-fp8")
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(got["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (256 // 64, 64 // 64)
    # an fp8 model.path in blocks other than the versions' is refused, naming the block that matches it
    other = load_config(ROOT / "configs" / "gptoss-tiny.yaml",
                        [f"model.path={out}", *fp8[1:], "weights.fp8_block_size=[32, 32]"])
    with pytest.raises(ValueError, match=r"is fp8 in \[64, 64\] blocks.*set weights.fp8_block_size=\[64, 64\]"):
        initial_model(other, tmp_path / "other")
