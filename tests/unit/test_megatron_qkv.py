"""qkv.py's fused q/k/v split, head norms and RoPE (qkv_kernels.py) in Triton's interpreter on the CPU.

`fused_qkv` against megatron's own path, step by step (the view, the split, the reshape, F.rms_norm and
megatron-core's `_apply_rotary_pos_emb_bshd`), outputs and the gradients of the projection and both norm
weights: float32 (to float32 rounding) and bf16 (a few bf16 ulps: the unfused path rounds after each step and
the interpreter truncates), with and without norms, a partial rotary width, padded [s, b] rows (a table row
per position) and a packed [T, 1] row, one query group and several, the last program's rows partial, a grad left
out. Then `FusedSelfAttention` as a layer: megatron's SelfAttention with our norms and core attention (the
reference) and the fused module with the same weights give the same outputs and gradients, plain RoPE, YaRN's
mscale and a packed micro-batch; where `_fusable` refuses (no rotary embedding, Triton off) megatron's path runs.
"""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.interpreter import assert_interpreted_ok  # noqa: E402

CHECK = r"""
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from offpolicy.learner.backends.megatron.kernels import qkv, rope

assert qkv.fused_runs(torch.zeros(1))
gen = torch.Generator().manual_seed(0)

def reference(mixed, groups, per, head, freqs, qw, kw, eps, mscale):
    s, b = mixed.shape[:2]
    x = mixed.view(s, b, groups, (per + 2) * head)
    q, k, v = torch.split(x, [per * head, head, head], dim=3)
    q = q.reshape(s, b, -1, head)
    if qw is not None:
        q, k = F.rms_norm(q, (head,), qw, eps), F.rms_norm(k, (head,), kw, eps)
    q = rope_utils._apply_rotary_pos_emb_bshd(q, freqs, mscale=mscale)
    k = rope_utils._apply_rotary_pos_emb_bshd(k, freqs, mscale=mscale)
    return q, k, v

def case(s, b, groups, per, head, rot, dtype, norm=True, mscale=1.0, skip_v=False):
    mixed = torch.randn(s, b, groups * (per + 2) * head, generator=gen).to(dtype).requires_grad_()
    freqs = torch.randn(s, 1, 1, rot, generator=gen) * 3
    qw = (torch.rand(head, generator=gen) + 0.5).to(dtype).requires_grad_() if norm else None
    kw = (torch.rand(head, generator=gen) + 0.5).to(dtype).requires_grad_() if norm else None
    cos_, sin_ = rope.tables(freqs, mscale, dtype)
    got = qkv.fused_qkv(mixed, groups, per, head, cos_, sin_, qw, kw, 1e-6)
    want = reference(mixed, groups, per, head, freqs, qw, kw, 1e-6, mscale)
    grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in want]
    if skip_v:
        got, want, grads = got[:2], want[:2], grads[:2]
    params = [mixed] + ([qw, kw] if norm else [])
    g_got = torch.autograd.grad(got, params, grads)
    g_want = torch.autograd.grad(want, params, grads)
    for what, a, e in zip(("q", "k", "v"), got, want):
        assert a.shape == e.shape and a.dtype == e.dtype and a.is_contiguous(), (what, a.shape, e.shape)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=f"{what} {s}x{b} {dtype}")
    for what, a, e in zip(("dmixed", "dqw", "dkw"), g_got, g_want):
        scale = float(e.abs().max())
        tol = (dict(rtol=1e-4, atol=1e-5 * scale) if dtype == torch.float32
               else dict(rtol=5e-2, atol=3e-2 * scale))
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=f"{what} {s}x{b} {dtype}")

case(7, 1, 2, 4, 16, 16, torch.float32)                    # a packed row: a table row per token
case(5, 3, 2, 2, 16, 16, torch.float32)                    # padded rows: a table row per position
case(9, 1, 1, 3, 32, 16, torch.float32, mscale=1.3)        # one group, a partial rotary width, YaRN's mscale
case(6, 2, 2, 2, 16, 16, torch.float32, norm=False)        # no head norms (GPT-OSS)
case(11, 1, 4, 8, 16, 16, torch.bfloat16)                  # Qwen3's grouping, bf16
case(5, 1, 2, 2, 16, 8, torch.bfloat16, norm=False, skip_v=True)  # v's gradient left out: zeros
case(3, 1, 2, 2, 24, 24, torch.float32)                    # a head that is no power of two: masked columns
print("ok")
"""

LAYER = r"""
import torch
from tests.megatron_cpu_shim import install
install()
import torch.distributed as dist
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import build_module
from offpolicy.learner.backends.megatron.kernels import norms, qkv
from offpolicy.learner.backends.megatron.kernels.attention import CoreAttention, packing

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
ps.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(0)

def layer(cls, qk_norm, **extra):
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=16,
                            attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32,
                            normalization="RMSNorm", qk_layernorm=qk_norm, layernorm_epsilon=1e-6, **extra)
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm).submodules.self_attention
    spec = norms.swap_modules(norms.with_norms(spec), {DotProductAttention: CoreAttention, SelfAttention: cls})
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1)

def run(module, hidden, **kw):
    hidden = hidden.detach().clone().requires_grad_()
    out, _ = module(hidden, attention_mask=None, **kw)
    w = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}  # linear_proj's bias
    # goes back to the layer unapplied: no gradient here
    module.zero_grad(set_to_none=True)
    return out.detach(), hidden.grad, grads

def same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    assert a[2].keys() == b[2].keys()
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-4, atol=1e-5, msg=n)

calls = []
real = qkv.fused_qkv
qkv.fused_qkv = lambda *a, **k: calls.append(1) or real(*a, **k)
for qk_norm in (True, False):
    ref, ours = layer(SelfAttention, qk_norm), layer(qkv.FusedSelfAttention, qk_norm)
    ours.load_state_dict(ref.state_dict())
    rotary = RotaryEmbedding(16, rotary_percent=1.0, rotary_base=10000)
    s, b = 10, 2
    hidden = torch.randn(s, b, 64)
    freqs = rotary(s)
    n = len(calls)
    same(run(ours, hidden, rotary_pos_emb=freqs), run(ref, hidden, rotary_pos_emb=freqs))       # padded rows
    assert len(calls) == n + 1
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2])                                   # packed documents
    pk = packing([0, 4, 7, 10], torch.device("cpu"))
    same(run(ours, hidden[:, :1], rotary_pos_emb=freqs[positions], packed_seq_params=pk),
         run(ref, hidden[:, :1], rotary_pos_emb=freqs[positions], packed_seq_params=pk))
    assert len(calls) == n + 2
    same(run(ours, hidden), run(ref, hidden))                                                  # no RoPE: megatron's
    assert len(calls) == n + 2
print("ok")
"""


def test_fused_qkv_in_the_interpreter_matches_megatrons_split_norms_and_rope():
    pytest.importorskip("triton")
    assert_interpreted_ok(CHECK)


def test_fused_self_attention_in_the_interpreter_matches_megatrons_self_attention():
    pytest.importorskip("triton")
    from tests.megatron_workers import free_port

    assert_interpreted_ok(LAYER % free_port())
