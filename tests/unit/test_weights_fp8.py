"""Tests for offpolicy.weights.fp8: block-wise e4m3 against an independent reference written here (numpy
float32 arithmetic and a table of every e4m3fn value), error bounds per block size, scale layout and
edge blocks, the skip list, and a version loaded by transformers' FineGrainedFP8 (dequantize=True)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from offpolicy.weights import fp8


def e4m3_table() -> np.ndarray:
    """Every finite non-negative e4m3fn value by code 0..126 (bias 7, 3 mantissa bits, no inf; 127 is nan)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


TABLE = e4m3_table()


def ref_round_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn value, ties to the even code (even mantissa), saturating at 448."""
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    d = np.abs(a[..., None] - TABLE)
    nearest = d == d.min(-1, keepdims=True)  # one code, or two at a tie
    even = nearest & (np.arange(127) % 2 == 0)
    pick = np.where(even.any(-1), even.argmax(-1), nearest.argmax(-1))
    return np.sign(x) * TABLE[pick]


def ref_quantize(w: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = w.shape
    scale = np.ones((-(-rows // bn), -(-cols // bk)), dtype=np.float32)
    q = np.zeros_like(w, dtype=np.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].astype(np.float32)
            amax = np.float32(np.abs(blk).max())
            s = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = ref_round_e4m3((blk / s).astype(np.float32))
    return q, scale


@pytest.mark.parametrize("shape,block", [((64, 96), (32, 32)), ((100, 72), (64, 64)), ((45, 180), (90, 90)),
                                         ((7, 5), (128, 128)), ((130, 260), (128, 128))])
def test_quantize_matches_reference_bit_for_bit(shape, block):
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=g) * torch.logspace(-4, 1, shape[1])).to(torch.bfloat16)
    w[: block[0], : block[1]] = 0.0  # an all-zero block
    q, s = fp8.quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))  # ceil-div: edge blocks included
    rq, rs = ref_quantize(w.float().numpy(), *block)
    assert np.array_equal(s.numpy(), rs)
    assert np.array_equal(q.float().numpy(), rq)
    assert s[0, 0] == 1.0 and bool((q[: block[0], : block[1]].float() == 0).all())


def test_scale_is_the_dequantization_multiplier_of_each_block_edge_blocks_cropped():
    q = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 10.0], [0.5, 4.0]])
    want = torch.tensor([[2.0, 4.0, 30.0], [8.0, 10.0, 60.0], [3.5, 4.0, 36.0]])
    assert torch.equal(fp8.dequantize(q, s, (2, 2), torch.float32), want)
    with pytest.raises(ValueError, match=r"needs a scale of \(2, 2\)"):
        fp8.dequantize(q, torch.ones(1, 1), (2, 2))


@pytest.mark.parametrize("block", [(128, 128), (64, 64), (90, 90)])
def test_error_bounds(block):
    w = torch.randn(2880 // 8, 2880 // 4, generator=torch.Generator().manual_seed(3))
    q, s = fp8.quantize(w, block)
    back = fp8.dequantize(q, s, block, torch.float32)
    se = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    err = (back - w).abs()
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, se * 2.0 ** -10) * (1 + 1e-6)).all()
    rel = ((back - w).norm() / w.norm()).item()
    assert 0.01 < rel < 0.03, rel  # ~0.022 for Gaussian blocks (docs/weights.md)
    assert torch.equal(fp8.dequantize(*fp8.quantize(back, block), block, torch.float32), back)  # representable: exact


def test_quantize_tensors_skips_norms_embeddings_router_and_biases():
    named = [("model.embed_tokens.weight", torch.randn(16, 64)), ("model.layers.0.input_layernorm.weight", torch.ones(64)),
             ("model.layers.0.mlp.gate.weight", torch.randn(4, 64)), ("model.layers.0.mlp.gate_proj.weight", torch.randn(128, 64)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(64)), ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64)),
             ("model.layers.0.mlp.experts.gate_up_proj", torch.randn(2, 64, 128)), ("lm_head.weight", torch.randn(16, 64))]
    out, kept = fp8.quantize_tensors(named, (64, 64))
    d = dict(out)
    assert d["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert d["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    assert d["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.experts.gate_up_proj", "lm_head.weight"):
        assert d[name].dtype == torch.float32 and name + "_scale_inv" not in d, name
    # GPT-OSS's 3-D experts stay native and are named too: vLLM and SGLang would build fp8 experts for them
    assert kept == ["model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts", "lm_head"]
    qc = fp8.quantization_config((64, 64), kept)
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64],
                  "ignored_layers": sorted(kept), "modules_to_not_convert": sorted(kept)}
    back = dict(fp8.dequantized_tensors(d.__getitem__, d, (64, 64), torch.float32))
    assert set(back) == {n for n, _ in named}
    with pytest.raises(KeyError, match="no model.layers.0.mlp.gate_proj.weight_scale_inv"):
        list(fp8.dequantized_tensors(d.__getitem__, ["model.layers.0.mlp.gate_proj.weight"], (64, 64)))
    assert fp8.module_matches("mlp.gate", "model.layers.3.mlp.gate")
    assert not fp8.module_matches("mlp.gate", "model.layers.3.mlp.gate_proj")


def test_transformers_loads_an_fp8_version(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer refuses to load without it
    cfg = transformers.AutoConfig.for_model("llama", vocab_size=32, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out, kept = fp8.quantize_tensors(model.state_dict().items(), (64, 64))  # divides every shape (transformers needs it)
    save_file({n: t.contiguous() for n, t in out}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    d = cfg.to_dict()
    d["quantization_config"] = fp8.quantization_config((64, 64), kept)
    (tmp_path / "config.json").write_text(json.dumps(d))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16,
        quantization_config=transformers.FineGrainedFP8Config(weight_block_size=(64, 64), dequantize=True))
    tensors = dict(out)
    ours = dict(fp8.dequantized_tensors(tensors.__getitem__, tensors, (64, 64), torch.bfloat16))
    state = loaded.state_dict()
    assert set(ours) == set(state)
    for name, t in ours.items():
        assert torch.equal(state[name], t), name
