"""Chunked logprobs from hidden states (offpolicy/learner/backends/megatron/kernels/logprobs.py) against full-logit autograd."""

import pytest
import torch

from offpolicy.learner.algorithms import token_entropy, token_logprobs
from offpolicy.learner.backends.megatron.kernels.logprobs import head_logprobs


def _case(seed: int, n=7, h=6, vocab=37, padded=40, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(padded, h, generator=g, dtype=dtype, requires_grad=True)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, tokens


@pytest.mark.parametrize("chunk_bytes", [1, 4 * 7 * 128 * 10], ids=["128-column-chunks", "one-chunk"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_their_gradients_equal_the_full_logits(chunk_bytes, temperature):
    hidden, weight, tokens = _case(0, n=7, h=6, vocab=300, padded=301)
    a, b = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    logp, ent = head_logprobs(hidden, weight, tokens, temperature, vocab_size=300, chunk_bytes=chunk_bytes)
    (logp * a + ent * b).sum().backward()
    got = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    logits = hidden @ weight[:300].t()  # the padded vocabulary row 300 is not part of the softmax
    ref_lp = token_logprobs(logits[None], tokens[None], temperature)[0]
    ref_ent = token_entropy(logits[None], temperature)[0]
    (ref_lp * a + ref_ent * b).sum().backward()
    for x, y in zip(got, (ref_lp, ref_ent, hidden.grad, weight.grad)):
        torch.testing.assert_close(x.double(), y.double(), rtol=1e-6, atol=1e-8)
    assert torch.all(got[3][300:] == 0)


def test_logprobs_alone_need_no_entropy_gradient():
    hidden, weight, tokens = _case(1)
    logp, _ = head_logprobs(hidden, weight, tokens, 1.0, vocab_size=37, chunk_bytes=1)
    logp.sum().backward()
    ref = hidden.detach().clone().requires_grad_(True)
    token_logprobs((ref @ weight.detach()[:37].t())[None], tokens[None])[0].sum().backward()
    torch.testing.assert_close(hidden.grad, ref.grad)


def test_bfloat16_matches_float32_logits_of_bfloat16_matmuls():
    hidden, weight, tokens = _case(2, dtype=torch.bfloat16)
    logp, ent = head_logprobs(hidden, weight, tokens, 1.0, vocab_size=37)
    logits = hidden.detach() @ weight.detach()[:37].t()  # bf16 logits, then float32 as the old path did
    torch.testing.assert_close(logp, token_logprobs(logits[None], tokens[None])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, token_entropy(logits[None])[0], rtol=1e-5, atol=1e-5)
    assert logp.dtype == torch.float32


def test_triton_chunks_equal_the_eager_chunks_in_the_interpreter():
    """The Triton path (logprob_kernels.py: the running stats folded in place, the gradient written over the logits'
    block, grad_hidden summed by moe_triton.accumulate) against the eager chunks in float32: several chunks and
    tiles (n and the vocabulary no multiple of a tile), one chunk, a temperature, the padded vocabulary row, a
    token in the last chunk, logp alone."""
    pytest.importorskip("triton")
    from tests.interpreter import assert_interpreted_ok

    assert_interpreted_ok(r'''
import torch
from offpolicy.learner.backends.megatron.kernels import logprobs

assert logprobs.triton_runs(torch.zeros(1)) and not logprobs.triton_runs(torch.zeros(1, dtype=torch.float64))
gen = torch.Generator().manual_seed(0)
for n, h, vocab, padded, chunk_bytes, temp, ent_on in ((13, 16, 700, 704, 1, 0.7, True),
                                                        (9, 8, 300, 301, 1 << 20, 1.0, True),
                                                        (5, 8, 260, 260, 1, 1.0, False)):
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = torch.randn(padded, h, generator=gen, requires_grad=True)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    tokens[-1] = vocab - 1
    a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    out = {}
    for fast in (True, False):
        logprobs.triton_runs = (lambda x: True) if fast else (lambda x: False)
        logp, ent = logprobs.head_logprobs(hidden, weight, tokens, temp, vocab_size=vocab, chunk_bytes=chunk_bytes)
        loss = (logp * a + ent * b).sum() if ent_on else (logp * a).sum()
        out[fast] = (logp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight)))
    for x, y in zip(out[True], out[False]):
        torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-5)
    assert torch.all(out[True][3][vocab:] == 0)
print("ok")
''')
