"""The low-bit formats on a real GPU (skipped without one): the Triton quantize kernels
(`offpolicy/weights/triton_quant.py`) and the MXFP4 dequantize (into a transposed view, as the torch engine's load
writes a parameter) give bit for bit what the eager functions give on the GPU and on the CPU, for whole and edge blocks and GPT-OSS's batched
(transposed) expert weights. tests/unit/test_weights_fp8.py and
test_weights_mxfp4.py check the formats themselves against independent references."""

import pytest
import torch

from offpolicy.weights import fp8, mxfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def weight(*shape: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    w.view(-1)[:: max(1, w.numel() // 97)] *= 40  # outliers: blocks with very different scales
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape,block", [((2880, 2880), (128, 128)), ((4096, 2880), (90, 90)),
                                         ((300, 200), (128, 128)), ((512, 2880), (64, 64))])
def test_fp8_compiled_equals_eager_on_gpu_and_cpu(shape, block):
    w = weight(*shape)
    q, s = fp8.quantize(w.cuda(), block)
    qe, se = fp8._quantize(w.cuda(), *block)
    qc, sc = fp8.quantize(w, block)
    for a, b in ((q, qe), (q, qc)):
        assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
    assert torch.equal(s.cpu(), se.cpu()) and torch.equal(s.cpu(), sc)
    back = fp8.dequantize(q, s, block, torch.bfloat16)
    assert torch.equal(back.cpu(), fp8.dequantize(qc, sc, block, torch.bfloat16))


@pytest.mark.parametrize("shape", [(4, 2880, 5760), (4, 2880, 2880), (64, 96)])
def test_mxfp4_kernels_equal_eager_on_gpu_and_cpu(shape):
    w = weight(*shape, seed=1)
    if len(shape) == 3:
        w = w.transpose(1, 2)  # the expert path quantizes the [E, out, in] transpose, not contiguous
    blocks, scales = mxfp4.quantize(w.cuda())
    be, se = mxfp4._quantize(w.cuda())
    bc, sc = mxfp4.quantize(w)
    assert torch.equal(blocks, be) and torch.equal(scales, se)
    assert torch.equal(blocks.cpu(), bc) and torch.equal(scales.cpu(), sc)
    back = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    assert torch.equal(back.cpu(), mxfp4.dequantize(bc, sc, torch.bfloat16))
    if len(shape) == 3:  # into a GptOssExperts parameter [E, in, out] through its transpose, as the engine loads it
        param = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        mxfp4.dequantize_into(blocks, scales, param.transpose(1, 2))
        assert torch.equal(param.transpose(1, 2), back) and param.is_contiguous()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_a_low_bit_version_decodes_on_the_gpu_as_on_the_cpu(tmp_path, fmt):
    from offpolicy.weights import WeightStore, WeightVersion
    from offpolicy.weights.formats import decode, encode

    named = [("model.layers.0.self_attn.q_proj.weight", weight(256, 2880)),
             ("model.layers.0.mlp.experts.gate_up_proj", weight(4, 2880, 512, seed=2)),
             ("model.layers.0.mlp.experts.gate_up_proj_bias", weight(4, 512, seed=3)),
             ("model.norm.weight", weight(2880, seed=4))]
    tensors, config = encode(fmt, [(n, t.cuda()) for n, t in named], {"model_type": "gpt_oss"})
    path = WeightStore(str(tmp_path), "r", fmt=fmt).publish(0, tensors, config).path
    with WeightVersion(path) as wv:
        gpu = dict(decode(wv, torch.bfloat16, "cuda"))
        cpu = dict(decode(wv, torch.bfloat16, "cpu"))
    assert gpu.keys() == cpu.keys() == {n for n, _ in named}
    for name, t in gpu.items():
        assert t.is_cuda and torch.equal(t.cpu(), cpu[name]), name
