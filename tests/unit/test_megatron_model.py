"""model.py's compiled RoPE (`compile_rope`) on the CPU: the same values as megatron-core's own, and one graph
per head count whatever the sequence length (aot_eager: no C compiler needed; dynamo's graphs are the same)."""

import functools

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from offpolicy.learner.backends.megatron import model  # noqa: E402
from offpolicy.learner.backends.megatron.kernels import rope  # noqa: E402


def test_compiled_rope_compiles_once_per_head_count_and_equals_megatrons(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(model, "_ROPE", {})  # this process's RoPE goes back to megatron's after the test
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", rope_utils._apply_rotary_pos_emb_bshd)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    plain = rope_utils._apply_rotary_pos_emb_bshd
    model.compile_rope()
    model.compile_rope()  # idempotent
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for s in (16, 37, 300):
        freqs = torch.randn(s, 1, 1, 32)
        for heads in (8, 2):  # q's and k's (grouped-query attention)
            t = torch.randn(s, 1, heads, 32, requires_grad=True)
            got = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, mscale=1.25)
            got.sum().backward()
            torch.testing.assert_close(got, plain(t, freqs, mscale=1.25))
    assert counters["stats"]["unique_graphs"] - before == 2  # one for each head count
    torch._dynamo.reset()


@pytest.mark.parametrize("interleaved", [False, True])
def test_compiled_rope_with_a_partial_rotary_width_and_interleaving_equals_megatrons(monkeypatch, interleaved):
    """The tables-first RoPE leaves the dims past the rotary width as they are and interleaves as megatron does;
    bf16 in, bf16 tables (megatron rounds its cos and sin to t's dtype too)."""
    monkeypatch.setattr(model, "_ROPE", {})
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", rope_utils._apply_rotary_pos_emb_bshd)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    plain = rope_utils._apply_rotary_pos_emb_bshd
    model.compile_rope()
    torch._dynamo.reset()
    freqs = torch.randn(23, 1, 1, 32) * 3
    t = torch.randn(23, 1, 4, 48).bfloat16()
    got = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved, mscale=0.9)
    want = plain(t, freqs, rotary_interleaved=interleaved, mscale=0.9)
    assert torch.equal(got[..., 32:], t[..., 32:])
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)
    torch._dynamo.reset()


def test_rope_tables_are_made_once_per_freqs_tensor(monkeypatch):
    """Every layer's q and k get the same freqs tensor from megatron: its cos/sin tables are computed once and
    made again for a new tensor, an in-place change of it, another mscale or dtype."""
    monkeypatch.setattr(model, "_ROPE", {})
    monkeypatch.setattr(rope, "_LAST", {})  # the tables' cache (kernels/rope.py)
    made = []
    real_cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: made.append(1) or real_cos(x))
    freqs = torch.randn(9, 1, 1, 16)
    first = model._tables(freqs, 1.0, torch.bfloat16)
    again = model._tables(freqs, 1.0, torch.bfloat16)
    assert len(made) == 1 and again[0] is first[0] and again[1] is first[1]
    torch.testing.assert_close(first[0], real_cos(freqs).bfloat16())
    model._tables(freqs, 2.0, torch.bfloat16)
    model._tables(freqs, 2.0, torch.float32)
    assert len(made) == 3
    freqs.mul_(2)  # the same tensor, changed in place
    torch.testing.assert_close(model._tables(freqs, 2.0, torch.float32)[0], real_cos(freqs) * 2)
    model._tables(freqs.clone(), 2.0, torch.float32)
    assert len(made) == 5
