"""A synthetic GRPO batch for learner benchmarks: random prompt and response tokens, behaviour
logprobs near those of a uniform policy (-log V +- 1), random rewards, every response cut by length.

    groups, advantages = synthetic_batch(seed=0, groups=32, n=8, prompt=128, response=384, vocab=151936)
"""

from __future__ import annotations

import math

import numpy as np


def synthetic_batch(*, seed: int, groups: int, n: int, prompt: int, response: int, vocab: int):
    """`groups` batch.Groups of `n` responses and their GRPO advantages (a torch tensor)."""
    import torch

    from offpolicy import algorithms
    from offpolicy.batch import Group

    rng = np.random.default_rng(seed)
    batch = [Group(g, 0, 0, 0, rng.integers(0, vocab, prompt).astype(np.int32),
                   [rng.integers(0, vocab, response).astype(np.int32) for _ in range(n)],
                   [(-math.log(vocab) + rng.uniform(-1, 1, response)).astype(np.float32) for _ in range(n)],
                   rng.random(n), ["length"] * n) for g in range(groups)]
    return batch, algorithms.compute_advantages(torch.tensor(np.stack([g.rewards for g in batch])))
