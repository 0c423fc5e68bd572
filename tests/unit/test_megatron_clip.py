"""clip.py against megatron-core's local (no Apex, no TE) fallbacks: the in-place scale gives the same bits, the
foreach norm the same norm to float32 rounding; install() swaps exactly those and nothing else; megatron's
clip_grad_by_total_norm_fp32 with them scales the gradients as before."""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core import utils  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402

from offpolicy.learner.backends.megatron import clip  # noqa: E402


def _grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * s for shape, s in (((300, 7), 1.0), ((5,), 30.0), ((0,), 1.0),
                                                                   ((64, 64), 1e-3))]


def test_scale_in_place_gives_megatrons_bits():
    want = [t.clone() for t in _grads()]
    utils.local_multi_tensor_scale(0, None, [want, want], 0.37)
    got = _grads()
    before = [t.data_ptr() for t in got]
    clip.scale(0, None, [got, got], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [t.data_ptr() for t in got] == before  # in place


def test_scale_of_distinct_lists_copies():
    src, dst = _grads(1), [torch.zeros_like(t) for t in _grads(1)]
    clip.scale(0, None, [src, dst], 2.0)
    assert all(torch.equal(d, s * 2.0) for s, d in zip(src, dst))


def test_norm_equals_megatrons_fallback():
    grads = _grads()
    want = torch.norm(torch.tensor([torch.norm(t) for t in grads]))  # megatron's fallback (which returns it on "cuda")
    got, none = clip.l2_norm(0, None, [grads], False)
    assert none is None and got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=0)
    assert float(clip.l2_norm(0, None, [[torch.zeros(0)]], False)[0]) == 0.0


def test_install_swaps_the_fallbacks_and_the_clip_scales_the_same(monkeypatch):
    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    assert clip.install() and clip.install()  # idempotent
    assert clip_grads.l2_norm_impl is clip.l2_norm and clip_grads.multi_tensor_scale_impl is clip.scale
    other = object()  # Apex's or TE's kernels: left alone
    monkeypatch.setattr(clip_grads, "l2_norm_impl", other)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", other)
    assert not clip.install() and clip_grads.l2_norm_impl is other
