"""qkv.py's fused q/k/v split, head norms and RoPE on one GPU in bf16, and batching's device-built packed
micro-batch.

At Qwen3-30B-A3B's attention (4 query groups of 8 heads, head 128, qk norms) and GPT-OSS's (8 groups of 8, head
64, no norms, YaRN's mscale), tokens no multiple of a program's rows: q, k, v and the gradients of the
projection and both norm weights against the same steps in float32 on the same bf16 inputs, at least as close
as megatron's own bf16 path (split, reshape, F.rms_norm, megatron's RoPE) is. Then both paths are timed at
125,243 tokens (Qwen3's benchmark micro-batch), forward and backward, printed for the record. The packed
micro-batch made on the GPU equals numpy's, bit for bit."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")
pytest.importorskip("megatron.core")

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from offpolicy.learner.backends.megatron import batching  # noqa: E402
from offpolicy.learner.backends.megatron.kernels import qkv, rope  # noqa: E402


def _unfused(mixed, groups, per, head, freqs, qw, kw, mscale, dtype):
    """megatron's path in `dtype` (the inputs cast to it)."""
    s, b = mixed.shape[:2]
    x = mixed.to(dtype).view(s, b, groups, (per + 2) * head)
    q, k, v = torch.split(x, [per * head, head, head], dim=3)
    q = q.reshape(s, b, -1, head)
    if qw is not None:
        q, k = F.rms_norm(q, (head,), qw.to(dtype), 1e-6), F.rms_norm(k, (head,), kw.to(dtype), 1e-6)
    return (rope_utils._apply_rotary_pos_emb_bshd(q, freqs, mscale=mscale),
            rope_utils._apply_rotary_pos_emb_bshd(k, freqs, mscale=mscale), v)


def _inputs(tokens, groups, per, head, norm, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mixed = torch.randn(tokens, 1, groups * (per + 2) * head, device="cuda", generator=g).to(torch.bfloat16)
    freqs = torch.rand(tokens, 1, 1, head, device="cuda", generator=g) * 50
    qw, kw = ((torch.rand(head, device="cuda", generator=g) + 0.5).to(torch.bfloat16) if norm else None
              for _ in range(2))
    return mixed, freqs, qw, kw


def _run(fn, mixed, qw, kw, grads):
    leaves = [t.detach().clone().requires_grad_() for t in (mixed, qw, kw) if t is not None]
    out = fn(*leaves, *([None, None] if len(leaves) == 1 else []))
    return [o.float() for o in out] + [g.float() for g in torch.autograd.grad(out, leaves, grads)]


@pytest.mark.parametrize("groups,per,head,norm,mscale", [(4, 8, 128, True, 1.0), (8, 8, 64, False, 1.35)],
                         ids=["qwen3", "gpt-oss"])
def test_fused_qkv_is_as_close_to_float32_as_megatrons_bf16_path(groups, per, head, norm, mscale):
    tokens = 3001
    mixed, freqs, qw, kw = _inputs(tokens, groups, per, head, norm)
    assert qkv.fused_runs(mixed)
    cos_, sin_ = rope.tables(freqs, mscale, torch.bfloat16)
    shapes = [(tokens, 1, groups * per, head), (tokens, 1, groups, head), (tokens, 1, groups, head)]
    grads = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in shapes]

    def fused(m, a, b):
        return qkv.fused_qkv(m, groups, per, head, cos_, sin_, a, b, 1e-6)

    def unfused(dtype):
        return lambda m, a, b: _unfused(m, groups, per, head, freqs, a, b, mscale, dtype)

    got = _run(fused, mixed, qw, kw, grads)
    ours_bf16 = _run(unfused(torch.bfloat16), mixed, qw, kw, grads)
    want = _run(unfused(torch.float32), mixed, qw, kw, [g.float() for g in grads])
    names = ["q", "k", "v", "dmixed", "dq_weight", "dk_weight"]
    for name, a, ref, e in zip(names, got, ours_bf16, want):
        err, ref_err = ((x - e).abs().max().item() / e.abs().max().item() for x in (a, ref))
        print(f"{name}: fused {err:.2e}, megatron's bf16 path {ref_err:.2e}")
        assert err <= 1.5 * ref_err + 1e-3, name


def test_fused_qkv_is_faster_at_qwen3s_micro_batch():
    tokens, groups, per, head = 125243, 4, 8, 128
    mixed, freqs, qw, kw = _inputs(tokens, groups, per, head, True)
    cos_, sin_ = rope.tables(freqs, 1.0, torch.bfloat16)
    shapes = [(tokens, 1, groups * per, head), (tokens, 1, groups, head), (tokens, 1, groups, head)]
    grads = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in shapes]
    paths = {"fused": lambda m, a, b: qkv.fused_qkv(m, groups, per, head, cos_, sin_, a, b, 1e-6),
             "megatron": lambda m, a, b: [t.contiguous() for t in
                                          _unfused(m, groups, per, head, freqs, a, b, 1.0, torch.bfloat16)]}
    ms = {}
    for name, fn in paths.items():
        for _ in range(2):
            _run(fn, mixed, qw, kw, grads)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            _run(fn, mixed, qw, kw, grads)
        end.record()
        torch.cuda.synchronize()
        ms[name] = start.elapsed_time(end) / 5
    print(f"q/k/v split, norms and RoPE, forward + backward at {tokens} tokens: fused {ms['fused']:.2f} ms, "
          f"megatron's eager path {ms['megatron']:.2f} ms")
    assert ms["fused"] < ms["megatron"]


def test_packed_micro_batch_made_on_the_gpu_equals_numpys():
    rng = np.random.default_rng(0)
    rows = [batching.Row(rng.integers(0, 2048, p).astype(np.int32), rng.integers(0, 2048, r).astype(np.int32),
                         rng.standard_normal(r).astype(np.float32), float(rng.standard_normal()))
            for p, r in zip(rng.integers(64, 256, 128), rng.integers(64, 1536, 128))]
    dev = torch.device("cuda")
    for dtype, multiple in ((torch.float32, 1), (torch.bfloat16, 4)):
        got, bounds = batching.concat(rows, dev, dtype, multiple)
        want, want_bounds = batching.concat_host(rows, dev, dtype, multiple)
        assert bounds == want_bounds and got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
