"""Tests for offpolicy.weights.mxfp4: quantize/dequantize against an independent per-element reference
written here, error bounds, the exact inverse on representable values, transformers' own MXFP4
dequantization (`_convert_moe_packed_tensors`), and a tiny GPT-OSS checkpoint loaded by transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from offpolicy.weights import mxfp4

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element by element in Python: OCP MX e2m1 with the smallest unclipped power-of-two scale, RNE."""
    rows = w.reshape(-1, w.shape[-1]).double().tolist()
    blocks, scales = [], []
    for row in rows:
        rb, rs = [], []
        for g0 in range(0, len(row), 32):
            grp = row[g0:g0 + 32]
            amax = max(abs(x) for x in grp)
            e = -127
            while 6.0 * 2.0 ** e < amax:
                e += 1
            e = min(e, 127)
            codes = []
            for x in grp:
                a = abs(x) / 2.0 ** e
                best = min(range(8), key=lambda c: (abs(GRID[c] - a), c % 2))  # nearest, ties to even code
                codes.append(best | (8 if x < 0 else 0))
            rb.append([codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)])
            rs.append(e + 127)
        blocks.append(rb)
        scales.append(rs)
    shape = (*w.shape[:-1], w.shape[-1] // 32)
    return (torch.tensor(blocks, dtype=torch.uint8).reshape(*shape, 16),
            torch.tensor(scales, dtype=torch.uint8).reshape(shape))


def ref_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out = []
    for bs, s in zip(blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()):
        for byte in bs:
            for code in (byte & 15, byte >> 4):
                out.append((-1 if code & 8 else 1) * GRID[code & 7] * 2.0 ** (s - 127))
    return torch.tensor(out, dtype=torch.float64).reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def _weights(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1] // 32).repeat_interleave(32)
    w[..., :32] = 0.0  # an all-zero group
    w[..., 40] = 1e-30  # a tiny value beside normal ones
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)])
def test_quantize_matches_reference_bit_for_bit(shape):
    w = _weights(0, shape)
    blocks, scales = mxfp4.quantize(w)
    rb, rs = ref_quantize(w)
    assert blocks.shape == (*shape[:-1], shape[-1] // 32, 16) and scales.shape == (*shape[:-1], shape[-1] // 32)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert torch.equal(blocks, rb) and torch.equal(scales, rs)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float64), ref_dequantize(blocks, scales))


def test_rounding_ties_to_even_code():
    # scale 1 (amax 6): each midpoint of the e2m1 grid, and the values around it
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor([6.0] + mids + [-m for m in mids] + [0.0] * (32 - 1 - 2 * len(mids)))
    got = mxfp4.dequantize(*mxfp4.quantize(x), torch.float32)
    assert got[1:1 + len(mids)].tolist() == want
    assert got[1 + len(mids):1 + 2 * len(mids)].tolist() == [-v for v in want]


def test_error_bound_and_exact_inverse():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    blocks, scales = mxfp4.quantize(w)
    back = mxfp4.dequantize(blocks, scales, torch.float32)
    s = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1)
    a = (w / s).abs()
    half_step = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    assert ((back - w).abs() <= half_step * s).all()
    amax = w.abs().reshape(64, 8, 32).amax(-1).repeat_interleave(32, dim=-1)
    assert ((back - w).abs() <= amax / 3).all()
    rel = (back - w).norm() / w.norm()
    assert 0.05 < rel < 0.2, rel  # ~0.1 for Gaussian groups of 32 (docs/weights.md)
    # representable values come back exactly (bytes may differ: a group whose max rounded down re-scales)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(back), torch.float32), back)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dequantize_into_a_strided_view_in_chunks_matches_the_reference(monkeypatch, dtype):
    """The torch engine's load: into a transposed view of a `[E, in, out]` parameter, a few rows at a time
    (`CHUNK` small: several chunks per expert, the last one partial), every scale byte 0..254 once at least."""
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 48, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 48, 2), dtype=torch.uint8, generator=g)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    scales.view(-1)[255:] = torch.randint(100, 140, (3 * 48 * 2 - 255,), dtype=torch.uint8, generator=g)  # finite in fp16
    monkeypatch.setattr(mxfp4, "CHUNK", 7 * 64)
    param = torch.full((3, 64, 48), float("nan"), dtype=dtype)  # GptOssExperts' [E, in, out]
    assert mxfp4.dequantize_into(blocks, scales, param.transpose(1, 2)) is not None
    want = ref_dequantize(blocks, scales).to(dtype)  # float64 per element, rounded once to dtype
    if dtype == torch.float16:  # outside fp16's range: compare where the reference is representable
        ok = (want.abs() < 65504) & ((want == 0) | (want.abs() >= 2 ** -24))
        assert torch.equal(param.transpose(1, 2)[ok], want[ok]) and ok.sum() > 0.5 * ok.numel()
    else:
        assert torch.equal(param.transpose(1, 2), want)
    assert param.stride() == (64 * 48, 48, 1)  # written in place: the parameter keeps its layout
    assert torch.equal(mxfp4.dequantize(blocks, scales, dtype), param.transpose(1, 2))
    edge = torch.tensor([[0, 254, 255]], dtype=torch.uint8)  # 2**-127 (subnormal), 2**127, inf (e8m0 255)
    ones = torch.full((1, 3, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    got = mxfp4.dequantize(ones, edge, torch.float32)
    assert torch.equal(got, torch.ldexp(torch.ones(1, 96), edge.to(torch.int32).repeat_interleave(32, -1) - 127))
    with pytest.raises(ValueError, match="not into"):
        mxfp4.dequantize_into(blocks, scales, param)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.ones(2, 33))
    with pytest.raises(ValueError, match="inf or nan"):
        mxfp4.quantize(torch.full((1, 32), math.inf))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


def test_transformers_dequantizes_our_blocks_the_same():
    tmx = pytest.importorskip("transformers.integrations.mxfp4")
    w = _weights(2, (4, 96, 64))  # [E, in, out] like GptOssExperts.gate_up_proj
    q = mxfp4.quantize_expert("model.layers.0.mlp.experts.gate_up_proj", w)
    blocks, scales = q["model.layers.0.mlp.experts.gate_up_proj_blocks"], q["model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert blocks.shape == (4, 64, 3, 16) and scales.shape == (4, 64, 3)  # [E, out, in/32, 16]
    theirs = tmx._convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dict(mxfp4.dequantized_tensors(q.__getitem__, q, torch.float32))
    assert list(ours) == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert theirs.shape == ours["model.layers.0.mlp.experts.gate_up_proj"].shape == w.shape
    assert torch.equal(theirs, ours["model.layers.0.mlp.experts.gate_up_proj"])
    assert ((theirs - w.float()).abs() <= w.float().abs().amax() / 3).all()


def test_dequantized_tensors_passes_others_and_names_missing_halves():
    e = "model.layers.1.mlp.experts.down_proj"
    q = mxfp4.quantize_expert(e, torch.randn(2, 64, 32))
    q["model.embed_tokens.weight"] = torch.ones(3, 2, dtype=torch.bfloat16)
    out = dict(mxfp4.dequantized_tensors(q.__getitem__, q))
    assert set(out) == {e, "model.embed_tokens.weight"} and out[e].shape == (2, 64, 32)
    assert out[e].dtype == torch.bfloat16 and out["model.embed_tokens.weight"] is q["model.embed_tokens.weight"]
    with pytest.raises(KeyError, match="down_proj_scales"):
        list(mxfp4.dequantized_tensors(q.__getitem__, [e + "_blocks"]))
    with pytest.raises(ValueError, match="not a GPT-OSS expert weight"):
        mxfp4.quantize_expert("model.layers.0.mlp.router.weight", torch.ones(4, 32))
    assert mxfp4.is_expert_weight("model.layers.3.mlp.experts.gate_up_proj")
    assert not mxfp4.is_expert_weight("model.layers.3.mlp.experts.gate_up_proj_bias")


TINY_GPT_OSS = dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=128, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"])


def test_transformers_loads_an_mxfp4_gpt_oss_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**TINY_GPT_OSS)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tensors = {}
    for name, t in model.state_dict().items():
        tensors.update(mxfp4.quantize_expert(name, t) if mxfp4.is_expert_weight(name) else {name: t.contiguous()})
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    d = cfg.to_dict()
    d["quantization_config"] = mxfp4.quantization_config()
    (tmp_path / "config.json").write_text(json.dumps(d))
    # without accelerate (not a dependency) transformers takes an MXFP4 checkpoint only with dequantize=True;
    # on CPU it dequantizes anyway (quantizer_mxfp4.py: "MXFP4 inference on CPU requires use_kernels=True")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True))
    ours = dict(mxfp4.dequantized_tensors(tensors.__getitem__, tensors))
    state = loaded.state_dict()
    assert set(ours) == set(state)
    for name, t in ours.items():
        assert torch.equal(state[name], t), name
