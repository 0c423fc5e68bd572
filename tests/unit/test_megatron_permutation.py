"""permutation.py against megatron-core's own unfused permute / unpermute (CPU, float32): forward values and
gradients equal, top-k 2 and 4, empty experts, tokens with fewer than k copies (the allgather dispatcher's
local experts), and the dispatcher module's functions swapped and restored by `install`."""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from megatron.core.transformer.moe import moe_utils  # noqa: E402

from offpolicy.learner.backends.megatron.kernels import permutation as P  # noqa: E402


def _routing(n: int, experts: int, topk: int, used: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A drop-free routing map [n, experts] (top-k of random scores over the first `used` experts: the rest
    get no token) and its probs (softmax over the chosen, zero elsewhere), as megatron's router gives them."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, experts, generator=g)
    scores[:, used:] = -1e9
    top, idx = scores.topk(topk, dim=1)
    probs = torch.zeros(n, experts).scatter(1, idx, torch.softmax(top, dim=1))
    return torch.zeros(n, experts, dtype=torch.bool).scatter(1, idx, True), probs


def _both(fn_ref, fn_ours, *inputs):
    """(outputs, input gradients) of both functions for the same inputs and a random output weighting."""
    res = []
    for fn in (fn_ref, fn_ours):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        outs = fn(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(7)
        loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs if o is not None)
        loss.backward()
        res.append(([o.detach() for o in outs if o is not None], [x.grad for x in xs]))
    return res


def _close(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool) -> None:
    for x, y in zip(a, b, strict=True):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("topk,used", [(2, 8), (2, 5), (4, 8), (4, 6)])
def test_permute_and_unpermute_equal_megatrons(topk, used):
    n, experts, hidden = 37, 8, 12
    routing_map, probs = _routing(n, experts, topk, used, seed=topk + used)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(1))
    num_out = n * topk

    def ref(x, probs):
        out, pp, _ = moe_utils.permute(x, routing_map, probs=probs, num_out_tokens=num_out)[:3]
        return out, pp

    def ours(x, probs):
        out, pp, _ = P.permute(x, routing_map, num_out, topk, probs)
        return out, pp

    (o_ref, g_ref), (o_ours, g_ours) = _both(ref, ours, x, probs)
    _close(o_ref, o_ours, exact=True)  # the same rows in the same order
    _close(g_ref, g_ours, exact=False)  # the token's k gradients summed in another order

    sorted_ref = moe_utils.permute(x, routing_map, num_out_tokens=num_out)[2]
    _, _, sorted_ours = P.permute(x, routing_map, num_out, topk)
    assert torch.equal(sorted_ref, sorted_ours)
    y = torch.randn(num_out, hidden, generator=torch.Generator().manual_seed(2))

    def ref_un(y):
        return moe_utils.unpermute(y, sorted_ref, restore_shape=x.shape, routing_map=routing_map)

    (o_ref, g_ref), (o_ours, g_ours) = _both(ref_un, lambda y: P.unpermute(y, sorted_ours), y)
    _close(o_ref, o_ours, exact=False)
    _close(g_ref, g_ours, exact=True)  # a gather either way

    def ref_weighted(y, probs):
        return moe_utils.unpermute(y, sorted_ref, restore_shape=x.shape, probs=probs, routing_map=routing_map)

    (o_ref, g_ref), (o_ours, g_ours) = _both(ref_weighted, lambda y, p: P.unpermute(y, sorted_ours, p), y, probs)
    _close(o_ref, o_ours, exact=False)
    _close(g_ref, g_ours, exact=False)


def test_tokens_with_fewer_copies_than_top_k():
    """The allgather dispatcher's map of this rank's experts: a token has 0..k copies here (padded rows)."""
    n, experts, topk, hidden = 29, 8, 2, 6
    full_map, probs = _routing(n, experts, topk, experts, seed=3)
    local_map, local_probs = full_map[:, 2:5].contiguous(), probs[:, 2:5].contiguous()
    assert {int(c) for c in local_map.sum(1)} >= {0, 1, 2}
    num_out = int(local_map.sum())
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(4))
    (o_ref, g_ref), (o_ours, g_ours) = _both(
        lambda x: moe_utils.permute(x, local_map, num_out_tokens=num_out)[0],
        lambda x: P.permute(x, local_map, num_out, topk)[0], x)
    _close(o_ref, o_ours, exact=True)
    _close(g_ref, g_ours, exact=False)
    sorted_ref = moe_utils.permute(x, local_map, num_out_tokens=num_out)[2]
    sorted_ours = P.permute(x, local_map, num_out, topk)[2]
    y = torch.randn(num_out, hidden, generator=torch.Generator().manual_seed(5))
    for p in (None, local_probs):
        extra = () if p is None else (p,)
        (o_ref, g_ref), (o_ours, g_ours) = _both(
            lambda y, *q: moe_utils.unpermute(y, sorted_ref, x.shape, probs=q[0] if q else None, routing_map=local_map),
            lambda y, *q: P.unpermute(y, sorted_ours, q[0] if q else None), y, *extra)
        _close(o_ref, o_ours, exact=False)
        _close(g_ref, g_ours, exact=False)


def test_bf16_sums_round_once():
    """In bf16 a token's copies are summed in float32 and rounded once (megatron: after every scatter-add)."""
    n, topk, hidden = 64, 4, 16
    routing_map, _ = _routing(n, 8, topk, 8, seed=6)
    _, _, sorted_ = P.permute(torch.zeros(n, hidden), routing_map, n * topk, topk)
    y = torch.randn(n * topk, hidden, generator=torch.Generator().manual_seed(8)).bfloat16()
    exact = torch.zeros(n, hidden, dtype=torch.float64).index_add_(0, sorted_, y.double())
    got = P.unpermute(y, sorted_)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8).all()  # within bf16's half unit


def test_no_tokens():
    routing_map = torch.zeros(0, 4, dtype=torch.bool)
    x = torch.zeros(0, 3, requires_grad=True)
    out, _, sorted_ = P.permute(x, routing_map, 0, 2)
    assert out.shape == (0, 3) and P.unpermute(out, sorted_).shape == (0, 3)


def test_install_swaps_the_dispatcher_functions_and_back():
    from megatron.core.transformer.moe import token_dispatcher as td

    plain = td.permute, td.unpermute, td.sort_chunks_by_idxs

    class Cfg:
        moe_router_topk = 2
        moe_router_padding_for_quantization = False

    try:
        P.install("gather", Cfg())
        assert (td.permute, td.unpermute, td.sort_chunks_by_idxs) == (
            P.megatron_permute, P.megatron_unpermute, P.megatron_sort_chunks)
        routing_map, probs = _routing(10, 4, 2, 4, seed=9)
        x = torch.randn(10, 3)
        got = td.permute(x, routing_map, probs=probs, num_out_tokens=20)
        want = plain[0](x, routing_map, probs=probs, num_out_tokens=20)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
        assert torch.allclose(td.unpermute(got[0], got[2], x.shape, routing_map=routing_map),
                              plain[1](want[0], want[2], x.shape, routing_map=routing_map))
        # megatron's own sorted indices (no routing attached) go to megatron's unpermute
        assert torch.equal(td.unpermute(want[0], want[2], x.shape, routing_map=routing_map),
                           plain[1](want[0], want[2], x.shape, routing_map=routing_map))
        sizes = torch.tensor([3, 0, 5, 2])
        rows = torch.randn(10, 3)
        assert td.sort_chunks_by_idxs(rows, sizes, torch.arange(4))[0] is rows  # identity order: no copy
        order = torch.tensor([2, 0, 3, 1])
        assert torch.equal(td.sort_chunks_by_idxs(rows, sizes, order)[0], plain[2](rows, sizes, order)[0])
        with pytest.raises(ValueError, match="moe_permute"):
            P.install("scatter", Cfg())
    finally:
        P.install("megatron")
    assert (td.permute, td.unpermute, td.sort_chunks_by_idxs) == plain


def test_compiled_sums_compile_once_and_equal_eager(monkeypatch):
    """`compile_sums` (a GPU learner's): the sums of each token's copies through torch.compile (aot_eager here:
    no C compiler needed; dynamo's graphs are the same) equal the eager gather-then-sum, forward (unpermute)
    and backward (permute), and token counts 16, 37, 300 run one graph."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(P, "_KERNELS", dict(P._KERNELS))  # the process-wide kernel stays uncompiled
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    P.compile_sums()
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for n in (16, 37, 300):
        routing_map, _ = _routing(n, 8, 4, 8, seed=n)
        x = torch.randn(n, 12, requires_grad=True)
        out, _, sorted_ = P.permute(x, routing_map, n * 4, 4)
        y = P.unpermute(out * 2, sorted_)
        y.backward(torch.ones_like(y))
        r = P.routing_of(sorted_)
        assert torch.allclose(y, 8 * x, atol=1e-5)  # 4 copies of x, each doubled
        assert torch.allclose(x.grad, torch.full_like(x, 8.0))
        with torch.no_grad():  # as in the autograd Functions' passes
            assert torch.equal(P._sum_copies(out, r), P.gathered_sum(out, r.inverse))
    assert counters["stats"]["unique_graphs"] - before == 1  # forward and backward, every count: one graph
    torch._dynamo.reset()


@pytest.mark.parametrize("experts", [1, 32, 128, 300])
def test_row_cumsum_equals_torchs_scan(experts):
    from offpolicy.learner.backends.megatron.kernels.permutation import _row_cumsum

    torch.manual_seed(experts)
    for m in (torch.rand(257, experts) < 0.3, torch.ones(5, experts, dtype=torch.bool),
              torch.zeros(0, experts, dtype=torch.bool)):
        assert torch.equal(_row_cumsum(m), torch.cumsum(m, 1))
