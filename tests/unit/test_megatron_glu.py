"""The dense MLP's SwiGLU module (offpolicy/learner/backends/megatron/kernels/glu.py): its Triton path (the experts'
GLU without row weights) in Triton's interpreter against megatron-core's SwiGLU math (its swiglu / swiglu_back, in
float32), float32 and bf16, [s, b, 2I] with I no multiple of a tile; its eager fallback; the config and spec that
put it into a dense family's layers (GPT-OSS's clamped gate and MoE families keep theirs)."""

import pytest
import torch

from tests.interpreter import assert_interpreted_ok

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

CHECK = r"""
import torch
from offpolicy.learner.backends.megatron.kernels import glu, moe_triton

assert moe_triton.available(torch.zeros(1))
gen = torch.Generator().manual_seed(0)
for s, b, I, dtype in ((13, 1, 300, torch.float32), (7, 2, 96, torch.bfloat16), (0, 1, 64, torch.bfloat16)):
    x = (torch.randn(s, b, 2 * I, generator=gen) * 3).to(dtype).requires_grad_()
    go = torch.randn(s, b, I, generator=gen).to(dtype)
    out = glu.SwiGLU()(x)
    assert out.shape == (s, b, I) and out.dtype == dtype
    g, u = x.detach().float().chunk(2, -1)
    ref = (torch.nn.functional.silu(g) * u).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, ref, **tol)
    if not s:
        continue
    (gx,) = torch.autograd.grad(out, x, go)
    gu = torch.sigmoid(g)
    ref_g = torch.cat((go.float() * gu * (1 + g * (1 - gu)) * u, go.float() * torch.nn.functional.silu(g)), -1)
    torch.testing.assert_close(gx, ref_g.to(dtype), **tol)
print("ok")
"""


def test_triton_swiglu_equals_megatrons_swiglu_math_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_ok(CHECK)


def test_eager_fallback_is_megatrons_unfused_glu(monkeypatch):
    from offpolicy.learner.backends.megatron.kernels import glu, moe_triton

    monkeypatch.setattr(moe_triton, "available", lambda t: False)
    x = torch.randn(5, 1, 16, dtype=torch.float64)
    g, u = x.chunk(2, -1)
    torch.testing.assert_close(glu.SwiGLU()(x), torch.nn.functional.silu(g) * u)


def test_swiglu_module_config_and_spec_only_for_dense_plain_silu_families():
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.mlp import MLPSubmodules

    from offpolicy.learner.backends.megatron import arch as A
    from offpolicy.learner.backends.megatron import families
    from offpolicy.learner.backends.megatron.kernels import glu, norms
    from tests.megatron_workers import TINY as T

    def config(hf, on):
        return A.transformer_config(families.from_hf(hf), tp=1, pp=1, sequence_parallel=False, dtype=torch.float32,
                                    recompute="none", recompute_layers=1, fused=True, swiglu_module=on)

    llama = config(T["llama"], True)
    assert llama.use_te_activation_func is True and llama.bias_activation_fusion is False
    assert config(T["llama"], False).use_te_activation_func is False
    gpt_oss = config(T["gpt_oss"], True)
    assert gpt_oss.use_te_activation_func is False and gpt_oss.bias_activation_fusion is False
    spec = glu.with_swiglu(norms.block_spec(specs.get_gpt_layer_local_spec(normalization="RMSNorm"), 2))
    found = []

    def walk(x):
        if isinstance(x, MLPSubmodules):
            found.append(x.activation_func)
        for v in (vars(x).values() if hasattr(x, "__dict__") else ()):
            walk(v)
        if isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        for v in getattr(x, "keywords", {}).values():
            walk(v)

    walk(spec)
    assert found == [glu.SwiGLU, glu.SwiGLU]
