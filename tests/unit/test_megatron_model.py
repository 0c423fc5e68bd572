"""model.py's compiled RoPE (`compile_rope`) on the CPU: the same values as megatron-core's own, and one graph
per head count whatever the sequence length (aot_eager: no C compiler needed; dynamo's graphs are the same)."""

import functools

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from offpolicy.backends.megatron import model  # noqa: E402


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
