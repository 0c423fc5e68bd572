"""offpolicy.bench.synthetic: the learner benchmarks' batch."""

import math

import numpy as np

from offpolicy.bench.synthetic import synthetic_batch


def test_batch_has_the_asked_shapes_and_group_normalised_advantages():
    groups, adv = synthetic_batch(seed=3, groups=4, n=5, prompt=7, response=11, vocab=100)
    assert len(groups) == 4 and adv.shape == (4, 5)
    for g in groups:
        assert g.prompt.shape == (7,) and g.n == 5
        assert all(r.shape == (11,) and r.max() < 100 for r in g.responses)
        assert all(abs(lp.mean() + math.log(100)) < 1 for lp in g.logprobs)
    np.testing.assert_allclose(adv.sum(dim=1).numpy(), 0, atol=1e-6)


def test_same_seed_same_batch():
    a, _ = synthetic_batch(seed=1, groups=2, n=2, prompt=3, response=4, vocab=50)
    b, _ = synthetic_batch(seed=1, groups=2, n=2, prompt=3, response=4, vocab=50)
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b))


def test_lengths_vary_within_the_asked_bounds():
    groups, _ = synthetic_batch(seed=2, groups=6, n=4, prompt=9, response=20, vocab=50, min_prompt=3,
                                min_response=1)
    prompts = {len(g.prompt) for g in groups}
    responses = [len(r) for g in groups for r in g.responses]
    assert prompts <= set(range(3, 10)) and len(prompts) > 1
    assert min(responses) >= 1 and max(responses) <= 20 and len(set(responses)) > 3
    assert all(len(lp) == len(r) for g in groups for r, lp in zip(g.responses, g.logprobs))
