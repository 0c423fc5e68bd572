"""experts.py's pure pieces on the CPU: the clamped GLU against hand arithmetic, the path choice, the refusals.
(The module in a model: test_megatron_moe.py / test_megatron_gpt_oss.py against SequentialMLP and the torch
backend; its checkpoints: test_megatron_dist_checkpoint.py; the grouped GEMMs: tests/gpu.)"""

import functools
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from offpolicy.backends.megatron import experts  # noqa: E402
from offpolicy.backends.megatron.arch import sigmoid_gate  # noqa: E402


def test_glu_is_the_clamped_gpt_oss_swiglu_weighted_by_the_probability():
    # one token, I = 2: gate (9, -1) -> clamped (7, -1); up (8, 0.5) -> clamped (7, 0.5)
    h = torch.tensor([[9.0, -1.0, 8.0, 0.5]])
    out = experts.glu(h, torch.tensor([0.0, 0.0, 0.0, 0.0]), torch.tensor([0.25]), alpha=1.702, limit=7.0, offset=1.0)
    want = [7 / (1 + math.exp(-1.702 * 7)) * (7 + 1) * 0.25, -1 / (1 + math.exp(1.702)) * (0.5 + 1) * 0.25]
    assert out.tolist()[0] == pytest.approx(want, rel=1e-6)


def test_glu_without_clamp_is_swiglu_and_adds_the_bias_first():
    h, b = torch.randn(5, 6), torch.randn(6)
    p = torch.rand(5)
    g, u = (h + b).chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u * p[:, None]
    assert torch.allclose(experts.glu(h, b, p, alpha=None, limit=None, offset=0.0), want, atol=1e-6)


def test_fc2_bias_is_weighted_by_the_probability():
    y, b, p = torch.randn(3, 4), torch.randn(4), torch.tensor([0.5, 1.0, 0.0])
    assert torch.allclose(experts.add_bias(y, b, p), y + b * p[:, None])


def test_grouped_gemms_run_only_on_bf16_hopper_gpus():
    assert not experts.grouped_mm_runs(torch.zeros(4, 16, dtype=torch.bfloat16), 16)  # a CPU tensor
    assert not experts.grouped_mm_runs(torch.zeros(4, 16), 16)


def test_activations_other_than_the_two_gates_are_refused_with_the_fix():
    assert experts._alpha(torch.nn.functional.silu) is None
    assert experts._alpha(functools.partial(sigmoid_gate, alpha=1.702)) == 1.702
    with pytest.raises(ValueError, match="learner.megatron.experts=sequential"):
        experts._alpha(torch.nn.functional.gelu)


def test_compiled_glu_compiles_once_whatever_the_token_count(monkeypatch):
    """The token count is symbolic from the first call (`_token_dim_dynamic`): micro-batches of 16, 37, 25 and 300
    tokens run one compiled graph, where automatic dynamic shapes compiled a static one first and a second at the
    next count (each compile of the real kernels costs seconds of a cold learner's first step). The backend
    here is aot_eager (no C compiler needed); dynamo's graphs are the same."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(experts, "_KERNELS", dict(experts._KERNELS))  # the process-wide kernels stay uncompiled
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    experts.compile_elementwise()
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for n in (16, 37, 25, 300):
        h, p = torch.randn(n, 8, requires_grad=True), torch.rand(n)
        experts._token_dim_dynamic(h, p)
        out = experts._KERNELS["glu"](h, None, p, alpha=1.702, limit=7.0, offset=1.0)
        out.sum().backward()
        assert torch.allclose(out, experts.glu(h, None, p, alpha=1.702, limit=7.0, offset=1.0), atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1
    torch._dynamo.reset()
