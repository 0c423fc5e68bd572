"""experts.py's pure pieces on the CPU: the clamped GLU against hand arithmetic, the path choice, the refusals.
(The module in a model: test_megatron_moe.py / test_megatron_gpt_oss.py against SequentialMLP and the torch
backend; its checkpoints: test_megatron_dist_checkpoint.py; the grouped GEMMs: tests/gpu.)"""

import functools
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from offpolicy.learner.backends.megatron.kernels import experts  # noqa: E402
from offpolicy.learner.backends.megatron.arch import sigmoid_gate  # noqa: E402
from tests.megatron_workers import grouped_experts  # noqa: E402


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
    rows, stacked = torch.tensor([2, 0, 2]), torch.randn(3, 4)  # the grouped path: each row's expert's bias
    assert torch.allclose(experts.add_bias(y, stacked, p, rows), y + stacked[rows] * p[:, None])


def test_grouped_gemms_run_only_on_bf16_hopper_gpus():
    assert not experts.grouped_mm_runs(torch.zeros(4, 16, dtype=torch.bfloat16), 16)  # a CPU tensor
    assert not experts.grouped_mm_runs(torch.zeros(4, 16), 16)


def test_activations_other_than_the_two_gates_are_refused_with_the_fix():
    assert experts._alpha(torch.nn.functional.silu) is None
    assert experts._alpha(functools.partial(sigmoid_gate, alpha=1.702)) == 1.702
    with pytest.raises(ValueError, match="learner.megatron.experts=sequential"):
        experts._alpha(torch.nn.functional.gelu)


def test_compiled_glu_compiles_once_whatever_the_token_count(monkeypatch):
    """`glu` and the grouped path's `glu_rows` (fc1's bias by row, the probability column): the token count is symbolic from the first call (`_token_dim_dynamic`): micro-batches of 16, 37, 25 and 300
    tokens run one compiled graph, where automatic dynamic shapes compiled a static one first and a second at the
    next count (each compile of the real kernels costs seconds of a cold learner's first step). The backend
    here is aot_eager (no C compiler needed); dynamo's graphs are the same."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(experts, "_KERNELS", dict(experts._KERNELS))  # the process-wide kernels stay uncompiled
    real, asked = torch.compile, {}

    def compile_(fn, options=None):  # aot_eager takes no inductor options: record them instead
        asked[fn.__name__] = options
        return real(fn, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_)
    experts.compile_elementwise()
    # the GLUs' backward joins the halves' gradients in place, not as inductor's pointwise cat
    assert asked["glu"] == asked["glu_rows"] and asked["glu"]["max_pointwise_cat_inputs"] == 1
    assert asked["add_bias"] is None
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for n in (16, 37, 25, 300):
        h, p = torch.randn(n, 8, requires_grad=True), torch.rand(n)
        experts._token_dim_dynamic(h, p)
        out = experts._KERNELS["glu"](h, None, p, alpha=1.702, limit=7.0, offset=1.0)
        out.sum().backward()
        assert torch.allclose(out, experts.glu(h, None, p, alpha=1.702, limit=7.0, offset=1.0), atol=1e-6)
        rows, bias = torch.randint(0, 3, (n,)), torch.randn(3, 8)  # the grouped path's GLU: fc1's bias by row
        experts._token_dim_dynamic(h, p, rows)
        out = experts._KERNELS["glu_rows"](h, bias, rows, p, 1.702, 7.0, 1.0)
        out.sum().backward()
        assert torch.allclose(out, experts.glu(h.detach() + bias[rows], None, p, 1.702, 7.0, 1.0), atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 2  # one graph each
    torch._dynamo.reset()


def _step(m, x, counts, probs):
    for p in m.parameters():
        p.grad = None
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y, _ = m(xg, counts, pg)
    (y.float() * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return {"output": y.detach().float(), "x": xg.grad.float(), "probs": pg.grad.float(),
            **{n: p.grad.float() for n, p in m.named_parameters()}}


@pytest.mark.parametrize("gpt_oss", [True, False], ids=["gpt_oss", "qwen3_moe"])
def test_grouped_path_with_folded_biases_equals_the_per_expert_loop(monkeypatch, gpt_oss):
    """The grouped path (torch._grouped_mm runs on the CPU in bf16 here) with fc1's bias in the GLU and fc2's in a
    kernel over its output, their gradients GEMMs: output and the gradients of x, the probabilities and every
    parameter agree with the per-expert loop in float32 within bf16 rounding; an expert without tokens gets
    zero gradients."""
    import copy

    torch.manual_seed(0)
    m = grouped_experts(gpt_oss, experts=6, hidden=32, ffn=16)
    counts = torch.tensor([5, 0, 17, 3, 9, 1])
    x = torch.randn(int(counts.sum()), 32).bfloat16()
    probs = torch.rand(x.shape[0])
    ref = _step(copy.deepcopy(m).float(), x.float(), counts, probs)
    monkeypatch.setattr(experts, "grouped_mm_runs", lambda *a: True)
    got = _step(m, x, counts, probs)
    for name, want in ref.items():
        err = float((got[name] - want).abs().max() / want.abs().max())
        assert err < 2e-2, (name, err)
    for name, p in m.named_parameters():
        assert torch.count_nonzero(got[name][1]) == 0, name  # expert 1 had no tokens
    if gpt_oss:  # the bias gradients are not all zero: the folds carry them
        assert got["linear_fc1.bias"].abs().sum() > 0 and got["linear_fc2.bias"].abs().sum() > 0
