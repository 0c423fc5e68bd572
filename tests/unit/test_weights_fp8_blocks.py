"""`weights.fp8_blocks`: the fp8 block sizes vLLM 0.26 / SGLang can serve for a model's linear shapes, and the
`auto` choice, as pure functions of `{checkpoint name: shape}`; the GPT-OSS-20B slice's shapes come from
transformers (built on the meta device), a Llama-like model's are written out."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from offpolicy.config import ModelConfig, load_config
from offpolicy.config.schema import ConfigError
from offpolicy.learner.backends.megatron.memory import gpt_oss_slice
from offpolicy.models import fp8_run
from offpolicy.models.build import arch_plan, build_model, model_shapes
from offpolicy.weights import fp8_blocks
from offpolicy.weights.formats import encode
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def gpt_oss():
    """The GPT-OSS-20B slice (hidden 2880, 64 heads / 8 KV heads of 64, 32 experts of 2880) as transformers
    names and shapes it."""
    return arch_plan(ModelConfig(arch=gpt_oss_slice(2)))[1]


def llama_like(hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, layers=2, experts=0):
    s = {"model.embed_tokens.weight": (128256, hidden), "lm_head.weight": (128256, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        s |= {a + "q_proj.weight": (heads * head_dim, hidden), a + "k_proj.weight": (kv * head_dim, hidden),
              a + "v_proj.weight": (kv * head_dim, hidden), a + "o_proj.weight": (hidden, heads * head_dim),
              p + "input_layernorm.weight": (hidden,)}
        mlps = [f"mlp.experts.{e}." for e in range(experts)] if experts else ["mlp."]
        for m in mlps:
            s |= {p + m + "gate_proj.weight": (inter, hidden), p + m + "up_proj.weight": (inter, hidden),
                  p + m + "down_proj.weight": (hidden, inter)}
        if experts:
            s[p + "mlp.gate.weight"] = (experts, hidden)
    return s


def test_the_gpt_oss_slice_takes_64_blocks_not_128(gpt_oss):
    linears = fp8_blocks.fp8_linears(gpt_oss)  # attention only: experts are 3-D, router / embeddings skipped
    assert linears["model.layers.0.self_attn.q_proj"] == (4096, 2880)
    assert linears["model.layers.0.self_attn.o_proj"] == (2880, 4096)
    assert not any("mlp" in m or "embed" in m or "lm_head" in m for m in linears)
    bad = fp8_blocks.problems(gpt_oss, (128, 128))  # what vLLM's engine core asserted on an H200
    assert len(bad) == 1 and "q_proj: input 2880 is not a multiple of 128" in bad[0]
    for tp in (1, 2, 4, 8):
        assert fp8_blocks.choose(gpt_oss, "vllm", tp) == (64, 64)
        assert fp8_blocks.resolve("auto", gpt_oss, "vllm", tp) == (64, 64)
    with pytest.raises(ValueError) as e:
        fp8_blocks.resolve((128, 128), gpt_oss, "vllm", 1)
    assert "weights.fp8_block_size=[128, 128]" in str(e.value) and "Set weights.fp8_block_size=[64, 64]" in str(e.value)
    assert "input 2880" in str(e.value)
    assert fp8_blocks.resolve((64, 64), gpt_oss, "vllm", 8) == (64, 64)
    # the torch engine dequantizes any block: what it is given, and auto is still the largest that serves
    assert fp8_blocks.resolve((128, 128), gpt_oss, "torch") == (128, 128)
    assert fp8_blocks.resolve((90, 90), gpt_oss, "torch") == (90, 90)
    assert fp8_blocks.resolve("auto", gpt_oss, "torch") == (64, 64)


def test_a_llama_like_model_keeps_128_blocks_up_to_tp8():
    s = llama_like()
    for tp in (1, 2, 4, 8):
        assert fp8_blocks.problems(s, (128, 128), "vllm", tp) == []
        assert fp8_blocks.resolve("auto", s, "vllm", tp) == (128, 128)
    # k/v of one KV head of 128: a TP2 split leaves 64 rows per rank, so 128 blocks no longer fit there
    one_kv = llama_like(kv=1)
    assert fp8_blocks.choose(one_kv, "vllm", 1) == (128, 128)
    assert fp8_blocks.choose(one_kv, "vllm", 2) == (64, 64)
    assert any("k_proj: output 64 per TP rank" in p for p in fp8_blocks.problems(one_kv, (128, 128), "vllm", 2))
    # a row-parallel input split: o_proj's 4096 over TP 64 is 64 per rank
    assert any("o_proj: input 64 per TP rank" in p for p in fp8_blocks.problems(s, (128, 128), "vllm", 64))


def test_vllm_takes_square_power_of_two_blocks_only():
    s = llama_like()
    for block in ((128, 64), (64, 128)):
        assert any("square" in p for p in fp8_blocks.problems(s, block, "vllm"))
    for block in ((96, 96), (8, 8)):
        assert any("powers of two >= 16" in p for p in fp8_blocks.problems(s, block, "vllm"))
    assert fp8_blocks.problems(s, (128, 64), "sglang") == []  # SGLang groups activations by the cols
    merged = fp8_blocks.problems(llama_like(hidden=2880, heads=45, head_dim=64), (90, 90), "sglang")
    assert any("a part of a merged linear" in p for p in merged)  # q out 2880 = 32 x 90, k/v out 512 are not


def test_vllm_fp8_experts_take_128_blocks_and_no_fit_names_fp8_skip():
    moe = llama_like(hidden=2880, heads=64, kv=8, head_dim=64, inter=768, experts=4)
    assert any("fp8 MoE experts" in p for p in fp8_blocks.problems(moe, (64, 64), "vllm"))
    assert fp8_blocks.choose(moe, "sglang") == (64, 64)
    with pytest.raises(ValueError, match="no square block of 128/64/32/16.*weights.fp8_skip"):
        fp8_blocks.resolve("auto", moe, "vllm")
    skip = ("embed_tokens", "lm_head", "mlp.gate", "mlp.experts")
    assert fp8_blocks.resolve("auto", moe, "vllm", 1, skip) == (64, 64)  # experts native: attention takes 64
    odd = llama_like(hidden=24, heads=2, kv=1, head_dim=12, inter=40)  # no candidate divides 24
    assert fp8_blocks.choose(odd) is None and fp8_blocks.resolve("auto", odd, "torch") == (128, 128)


def test_the_learner_and_the_launcher_read_the_same_shapes(tmp_path):
    """The learner resolves `auto` from model.arch built on the meta device, the vLLM launch from the saved
    checkpoint's safetensors headers: the same fp8 linears, so the same block."""
    cfg = load_config(ROOT / "configs" / "gptoss-tiny.yaml", ["model.dtype=bfloat16", "model.arch.head_dim=64"])
    build_model(cfg.model, torch.device("cpu")).save_pretrained(tmp_path / "m", max_shard_size="200KB")
    built, saved = model_shapes(cfg.model), fp8_blocks.checkpoint_shapes(tmp_path / "m")
    assert fp8_blocks.fp8_linears(built) == fp8_blocks.fp8_linears(saved) != {}
    assert model_shapes(cfg.model, str(tmp_path / "m")) == saved
    assert fp8_blocks.checkpoint_shapes(tmp_path / "nothing") == {}
    save_file({"a.weight": torch.zeros(3, 5)}, str(tmp_path / "x.safetensors"))
    assert fp8_blocks.checkpoint_shapes(tmp_path) == {"a.weight": (3, 5)}


def test_the_run_resolves_its_block_in_one_place(tmp_path):
    """`fp8_run.block` (the learner, the Megatron publish, the vLLM launch): weights.fp8_block_size resolved for the
    run's engine against model.arch built on the meta device or a checkpoint's headers, the same block either way;
    `fp8_run.resolved`: the weights section with it where fp8 versions are written, else as it was."""
    import msgspec

    cfg = load_config(ROOT / "configs" / "gptoss-tiny.yaml", ["model.arch.head_dim=64", "weights.formats=[fp8]"])
    assert fp8_run.block(cfg) == fp8_blocks.for_run(cfg, model_shapes(cfg.model)) == (64, 64)
    build_model(cfg.model, torch.device("cpu")).save_pretrained(tmp_path / "m")
    assert fp8_run.block(cfg, path=str(tmp_path / "m")) == (64, 64)
    assert fp8_run.block(cfg, [32, 32]) == (32, 32)  # a given block (e.g. a checkpoint's own), as the engine serves it
    vllm = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, engine="vllm"))
    with pytest.raises(ValueError, match=r"weights.fp8_block_size=\[128, 128\] cannot be served by rollout.engine=vllm"):
        fp8_run.block(vllm, (128, 128))
    w = fp8_run.resolved(cfg)
    assert w.fp8_block_size == (64, 64) and w == msgspec.structs.replace(cfg.weights, fp8_block_size=(64, 64))
    native = msgspec.structs.replace(cfg.weights, formats=[])
    assert fp8_run.resolved(cfg, native) is native  # no fp8 written: left as it is
    assert fp8_run.resolved(cfg, native, ["fp8"]).fp8_block_size == (64, 64)  # fp8 among a publish's formats


def test_encode_resolves_auto_from_the_tensors():
    named = [("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 2880)),
             ("model.layers.0.self_attn.o_proj.weight", torch.randn(2880, 256))]
    tensors, config = encode("fp8", named, {}, "auto")
    assert config["quantization_config"]["weight_block_size"] == [64, 64]
    assert dict(tensors)["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (4, 45)


def test_sglang_serves_no_fp8_gpt_oss_attention(gpt_oss):
    """SGLang 0.5.14 builds GPT-OSS's attention without its quantization config: an fp8 version's attention would load
    unscaled into bf16 (its loads failed their fingerprint proof on an H200), so fp8 GPT-OSS versions are refused for
    SGLang at every block and TP size, naming the engine that serves them; a model without attention sinks, or a
    GPT-OSS whose attention fp8_skip keeps native, is not refused."""
    for tp in (1, 2):
        assert fp8_blocks.choose(gpt_oss, "sglang", tp) is None
        for setting in ("auto", (64, 64)):
            with pytest.raises(ValueError) as e:
                fp8_blocks.resolve(setting, gpt_oss, "sglang", tp)
            assert "rollout.engine=sglang" in str(e.value) and "serve fp8 GPT-OSS versions with rollout.engine=vllm" \
                in str(e.value) and "models/gpt_oss.py:512-527" in str(e.value)
    skip = (*fp8_blocks.DEFAULT_SKIP, "self_attn")
    assert fp8_blocks.unserved(fp8_blocks.fp8_linears(gpt_oss, skip), gpt_oss, "sglang") == ""
    assert fp8_blocks.resolve("auto", llama_like(), "sglang") == (128, 128)
    cfg = load_config(ROOT / "configs" / "gptoss-tiny.yaml", ["rollout.engine=sglang", "weights.formats=[fp8]",
                                                               "rollout.weights_format=fp8", "model.arch.head_dim=64"])
    with pytest.raises(ValueError, match="SGLang 0.5.14 builds GPT-OSS's attention"):
        fp8_run.block(cfg)  # what the learner resolves at its start


def test_the_config_check_refuses_blocks_vllm_cannot_serve():
    fp8 = ["weights.formats=[fp8]", "rollout.weights_format=fp8"]
    for block in ("[90, 90]", "[128, 64]", "[8, 8]"):
        with pytest.raises(ConfigError, match=r"weights.fp8_block_size: is .*which vLLM cannot serve"):
            load_config(ROOT / "configs" / "quickstart-vllm.yaml", [*fp8, f"weights.fp8_block_size={block}"])
    assert load_config(ROOT / "configs" / "quickstart-vllm.yaml", fp8).weights.fp8_block_size == "auto"
    assert load_config(ROOT / "configs" / "quickstart.yaml",  # the torch engine takes any block
                       [*fp8, "weights.fp8_block_size=[90, 90]"]).weights.fp8_block_size == (90, 90)
