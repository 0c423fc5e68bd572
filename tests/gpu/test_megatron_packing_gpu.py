"""The learner's fast paths on one GPU: flash core attention (packed, window, sinks), the chunked logprob's
Triton and compiled passes, and a packed training step against the padded one, in bf16."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("fresh_parallel_state")]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.megatron_workers import batch, free_port, overrides  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("left,sinks,groups", [(-1, False, 8), (-1, True, 2), (127, True, 8), (31, False, 32)],
                         ids=["gqa", "sinks", "window-sinks", "window-mha"])
def test_flash_varlen_matches_the_reference_bf16(left, sinks, groups):
    """Forward and backward of the packed flash path (fresh random inputs) against reference_attention run
    in float64 on the same bf16 inputs: relative error of a bf16 computation (< 1e-2)."""
    from offpolicy.learner.backends.megatron.kernels.attention import _Flash, reference_attention

    torch.manual_seed(int(left) + 7 * groups + sinks)
    bounds = [0, 300, 301, 1000, 1450, 2048]  # one-token and longer-than-window documents
    dev, total, heads, dim = torch.device("cuda"), bounds[-1], 32, 64
    q = torch.randn(total, heads, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, groups, dim, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    sink = torch.randn(heads, device=dev, dtype=torch.bfloat16, requires_grad=True) if sinks else None
    grad = torch.randn(total, heads, dim, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    out = _Flash.apply(q, k, v, sink, cu, 700, dim ** -0.5, left)
    inputs = [t for t in (q, k, v, sink) if t is not None]
    got = [out, *torch.autograd.grad(out, inputs, grad)]
    wide = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = reference_attention(wide[0], wide[1], wide[2], bounds, dim ** -0.5, left, wide[3] if sinks else None)
    want = [ref, *torch.autograd.grad(ref, wide, grad.double())]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsink"], got, want):
        print(name, _rel(a, b))
        assert _rel(a, b) < 1e-2, name


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1 << 30], ids=["chunks", "one-chunk"])
def test_triton_and_compiled_chunked_logprobs_equal_eager_bf16(monkeypatch, chunk_bytes):
    """The chunks' passes as the Triton kernels (the GPU's default, logprob_kernels.py) and compiled, against eager
    torch on the same bf16 inputs, with a float64 reference of the same bf16 logits for scale."""
    from offpolicy.learner.backends.megatron.kernels import logprobs

    torch.manual_seed(0)
    dev = torch.device("cuda")
    hidden = torch.randn(3001, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(32000, 512, device=dev, dtype=torch.bfloat16) / 8).requires_grad_(True)
    tokens = torch.randint(0, 31990, (3001,), device=dev)
    a, b = torch.randn(3001, device=dev), torch.randn(3001, device=dev)
    assert logprobs.triton_runs(hidden)
    outs = {}
    for how in ("eager", "compiled", "triton"):
        monkeypatch.setattr(logprobs, "triton_runs", lambda h, on=how == "triton": on)
        logp, ent = logprobs.head_logprobs(hidden, weight, tokens, 0.8, vocab_size=31990, chunk_bytes=chunk_bytes,
                                           compile=how == "compiled")
        outs[how] = [logp, ent, *torch.autograd.grad((logp * a + ent * b).sum(), (hidden, weight))]
    for how in ("compiled", "triton"):
        for name, x, y in zip(["logp", "entropy", "d hidden", "d weight"], outs[how], outs["eager"]):
            print(how, name, _rel(x, y))
            assert _rel(x, y) < 2e-3, (how, name)
    assert torch.all(outs["triton"][3][31990:] == 0)


def test_packed_step_matches_the_padded_step_bf16():
    """The same batch (responses of different lengths) trained packed and padded: the same GRPO step."""
    from offpolicy.config import load_config
    from offpolicy.learner.backends.megatron.backend import MegatronBackend

    import os

    os.environ["MASTER_PORT"] = str(free_port())
    args = overrides("llama", "model.dtype=bfloat16", "learner.device=cuda", "learner.backend=megatron")
    groups, adv = batch()
    stats = {}
    for packing in (False, True):
        mb = MegatronBackend(load_config(None, args + [f"learner.megatron.packing={str(packing).lower()}"]))
        stats[packing] = [mb.train_step(groups, adv) for _ in range(2)]
        del mb
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    for a, b in zip(stats[True], stats[False]):
        print({k: (a[k], b[k]) for k in ("loss", "grad_norm", "entropy")})
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2, abs=1e-3)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-2)
