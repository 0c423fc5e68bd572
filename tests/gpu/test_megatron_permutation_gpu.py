"""permutation.py on one GPU: forward and backward never wait for the GPU (CUDA sync debug mode "error"),
and in bfloat16 at Qwen3-30B-A3B's routing shape they equal megatron-core's unfused permute / unpermute
(permute: the same rows; sums over a token's copies within bf16 rounding)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.transformer.moe import moe_utils  # noqa: E402

from offpolicy.learner.backends.megatron.kernels import permutation as P  # noqa: E402


def _routing(n: int, experts: int, topk: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    top, idx = torch.randn(n, experts, device="cuda", generator=g).topk(topk, dim=1)
    probs = torch.zeros(n, experts, device="cuda").scatter(1, idx, torch.softmax(top, dim=1))
    return torch.zeros(n, experts, dtype=torch.bool, device="cuda").scatter(1, idx, True), probs


@pytest.mark.parametrize("experts,topk", [(128, 8), (32, 4)], ids=["qwen3-30b-a3b", "gpt-oss-20b"])
def test_no_host_sync_and_bf16_equal_megatron(experts, topk):
    n, hidden = 8192, 2048
    routing_map, probs = _routing(n, experts, topk)
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = probs.clone().requires_grad_(True)
    g_out = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, pp, sorted_ = P.permute(x, routing_map, n * topk, topk, p)
        y = P.unpermute(out * pp.unsqueeze(1).to(out.dtype), sorted_)
        y.backward(g_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    xr = x.detach().clone().requires_grad_(True)
    pr = probs.clone().requires_grad_(True)
    out_r, pp_r, sorted_r = moe_utils.permute(xr, routing_map, probs=pr, num_out_tokens=n * topk)[:3]
    y_r = moe_utils.unpermute(out_r * pp_r.unsqueeze(1).to(out_r.dtype), sorted_r, restore_shape=x.shape,
                              routing_map=routing_map)
    y_r.backward(g_out)
    assert torch.equal(sorted_, sorted_r) and torch.equal(out, out_r) and torch.equal(pp, pp_r)
    for ours, ref in ((y, y_r), (x.grad, xr.grad), (p.grad, pr.grad)):
        err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, err
