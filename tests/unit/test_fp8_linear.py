"""The fp8 linear of the torch engine (rollout.fp8_matmul, issue 53) on the CPU, against float64 references written
here: activations quantized per token in 1 x 128 groups within e4m3's bound, the reference kernel's product equal to
the float64 product of the same quantized operands, and the layer's output within the activation rounding's bound
of the float64 product with the dequantized weights (what the dequantize path computes). Shapes with partial edge
blocks and a partial last activation group, a bias."""

from __future__ import annotations

import pytest
import torch

from offpolicy.rollout.engines.fp8_linear import (GROUP, Fp8Linear, cuda_product, kernel_problems,
                                                  quantize_activations, reference_product)
from offpolicy.weights import fp8

E4M3_MAX = 448.0


def ref_expand(scale: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """float64 per-element scale: scale[i // bn, j // bk]."""
    i = torch.arange(rows)[:, None] // bn
    j = torch.arange(cols)[None, :] // bk
    return scale.to(torch.float64)[i, j]


def spread(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, cols), generator=g) * torch.logspace(-2, 1, cols)  # magnitudes spread within groups


@pytest.mark.parametrize("k", [64, 200, 256])
def test_fp8_activations_are_quantized_per_token_in_groups_of_128(k):
    x = spread(5, k, 0)
    x[3] = 0.0  # an all-zero token: scale 1, codes 0
    q, s = quantize_activations(x)
    groups = -(-k // GROUP)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, groups) and s.dtype == torch.float32
    xd = x.to(torch.float64)
    for g in range(groups):
        part = xd[:, g * GROUP:(g + 1) * GROUP]
        amax = part.abs().amax(-1)
        want = torch.where(amax > 0, (amax.float() / E4M3_MAX).double(), torch.ones_like(amax))
        assert torch.equal(s[:, g].double(), want), g
    back = q.to(torch.float64) * ref_expand(s, 5, k, 1, GROUP)
    sd = ref_expand(s, 5, k, 1, GROUP)
    bound = torch.maximum(xd.abs() * 2 ** -4, sd * 2 ** -10) * (1 + 1e-6)  # 3 mantissa bits; e4m3's subnormal step
    assert bool(((back - xd).abs() <= bound).all())
    assert (back - xd).abs().max() > 0  # rounding happened: the test sees the format
    assert bool((back[3] == 0).all())


@pytest.mark.parametrize("block, k, n", [((128, 128), 256, 384), ((24, 40), 200, 72), ((64, 64), 192, 64)])
def test_fp8_scaled_linear_matches_a_float64_dequantized_reference(block, k, n):
    w = spread(n, k, 1) * 0.05
    x = spread(7, k, 2)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    dense = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        dense.weight.copy_(w)
        dense.bias.copy_(bias)
    lin = Fp8Linear.of(dense, block, "reference")
    q, s = fp8.quantize(w, block)
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(lin.weight_scale_inv, s)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv.dtype == torch.float32

    w64 = q.to(torch.float64) * ref_expand(s, n, k, *block)  # the version's weights, dequantized in float64
    xq, xs = quantize_activations(x)
    x64 = xq.to(torch.float64) * ref_expand(xs, 7, k, 1, GROUP)
    # the reference kernel is the float64 product of the same quantized operands, to float32 accumulation
    same = x64 @ w64.T
    got = reference_product(xq, xs, lin.weight, lin.weight_scale_inv, block).double()
    assert (got - same).abs().max() <= 1e-5 * same.abs().max()

    # the layer against the dequantize path's product (x unquantized, the same weights): the activations' rounding
    with torch.no_grad():
        y = lin(x.reshape(7, 1, k)).reshape(7, n).double()
    exact = x.double() @ w64.T + bias.double()
    xerr = torch.maximum(x.double().abs() * 2 ** -4, ref_expand(xs, 7, k, 1, GROUP) * 2 ** -10)
    bound = xerr @ w64.abs().T + 1e-5 * exact.abs().max()  # + float32 accumulation
    assert bool(((y - exact).abs() <= bound).all())
    rel = ((y - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.05, rel  # measurably quantized, and close: ~2^-5 relative per activation


def test_fp8_kernel_problems_name_what_torch_scaled_mm_takes():
    llama = {"model.layers.0.self_attn.q_proj": (4096, 4096), "model.layers.0.mlp.down_proj": (4096, 14336)}
    assert kernel_problems(llama, (128, 128)) == []
    gpt_oss = {"model.layers.0.self_attn.q_proj": (4096, 2880), "model.layers.0.self_attn.o_proj": (2880, 4096)}
    why = kernel_problems(gpt_oss, (64, 64))
    assert len(why) == 3 and "128 x 128 blocks" in why[0] and "q_proj: input 2880 is not a multiple of 128" in why[1]
    assert kernel_problems(gpt_oss, (128, 128)) == why[1:] == [why[1], "model.layers.0.self_attn.o_proj: output 2880 is not a "
                                                   "multiple of 128 (torch's checks count 128-row weight blocks by "
                                                   "floor division)"]
    assert "output 72" in kernel_problems({"m": (72, 128)}, (128, 128))[0]


@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (7, 1024, 4096), (64, 384, 384), (512, 14336, 4096)])
def test_fp8_cuda_operands_pass_torch_scaled_mm_checks(m, n, k):
    """torch's own shape and stride checks of `scaled_mm` (its meta function, the one torch.compile traces with)
    take the operands `cuda_product` builds, at one token too; a weight of 2880 rows they do not."""
    x = torch.empty((m, k), device="meta", dtype=torch.bfloat16)
    w = torch.empty((n, k), device="meta", dtype=torch.float8_e4m3fn)
    ws = torch.empty((n // 128, k // 128), device="meta", dtype=torch.float32)
    bias = torch.empty(n, device="meta", dtype=torch.bfloat16)
    y = cuda_product(*quantize_activations(x), w, ws, bias, torch.bfloat16)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    if m == 7:  # GPT-OSS's o_proj in 128 x 128 blocks: 23 block rows, which torch counts as 22
        w, ws = w.new_empty((2880, k)), ws.new_empty((23, k // 128))
        with pytest.raises(RuntimeError, match="scale b must have shape"):
            cuda_product(*quantize_activations(x), w, ws, None, torch.bfloat16)


def test_fp8_linear_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="cuda or reference"):
        Fp8Linear(128, 128, (128, 128), False, "triton")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="torch's block-scaled fp8 matmul runs on SM90 GPUs")
def test_fp8_cuda_kernel_matches_the_reference():
    dense = torch.nn.Linear(512, 384, bias=True, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 64, 300):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        lin = Fp8Linear.of(dense, (128, 128), "cuda")
        with torch.no_grad():
            y = lin(x).float()
            ref = reference_product(*quantize_activations(x), lin.weight, lin.weight_scale_inv, (128, 128))
            ref = ref + dense.bias.float()
        assert (y - ref).abs().max() <= 1e-2 * ref.abs().max(), rows
