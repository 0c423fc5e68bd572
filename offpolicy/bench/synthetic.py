"""A synthetic GRPO batch for learner benchmarks: random prompt and response tokens, behaviour
logprobs near those of a uniform policy (-log V +- 1), random rewards, every response cut by length.

Lengths are fixed (`prompt`, `response`) or, with `min_prompt` / `min_response`, drawn uniformly per
group (prompt) and per response in [min, max]: GRPO responses differ in length, which is what
padding wastes and packing recovers.

    groups, advantages = synthetic_batch(seed=0, groups=32, n=8, prompt=128, response=384, vocab=151936)
    groups, advantages = synthetic_batch(seed=0, groups=16, n=8, prompt=256, response=1536, vocab=128256,
                                         min_prompt=64, min_response=64)
"""

from __future__ import annotations

import math

import numpy as np


def synthetic_batch(*, seed: int, groups: int, n: int, prompt: int, response: int, vocab: int,
                    min_prompt: int | None = None, min_response: int | None = None):
    """`groups` batch.Groups of `n` responses and their GRPO advantages (a torch tensor)."""
    import torch

    from offpolicy.hub.batch import Group
    from offpolicy.learner import algorithms

    rng = np.random.default_rng(seed)

    def length(lo: int | None, hi: int) -> int:
        return hi if lo is None else int(rng.integers(lo, hi + 1))

    batch = []
    for g in range(groups):
        p = rng.integers(0, vocab, length(min_prompt, prompt)).astype(np.int32)
        lens = [length(min_response, response) for _ in range(n)]
        batch.append(Group(g, 0, 0, 0, p, [rng.integers(0, vocab, k).astype(np.int32) for k in lens],
                           [(-math.log(vocab) + rng.uniform(-1, 1, k)).astype(np.float32) for k in lens],
                           rng.random(n), ["length"] * n))
    return batch, algorithms.compute_advantages(torch.tensor(np.stack([g.rewards for g in batch])))
