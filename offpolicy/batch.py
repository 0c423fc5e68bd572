"""In-memory sample groups as the learner holds them, and their reduction to step statistics.

A `Group` is one prompt's `n` responses as received from a rollout (decoded from a `SampleGroup`
message and its array frames); a training batch is a list of groups. The arrays are owned copies,
never views on ZeroMQ frames.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass
class Group:
    prompt_id: int
    epoch: int
    lease_id: int
    weight_version: int  # version the responses were generated with
    prompt: np.ndarray  # int32 prompt tokens
    responses: list[np.ndarray]  # int32 tokens per response
    logprobs: list[np.ndarray]  # float32 behaviour logprobs per response
    rewards: np.ndarray  # float64 [n]
    finish_reasons: list[str]
    daemon: str = ""

    @property
    def n(self) -> int:
        return len(self.responses)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


def split_frames(lengths: list[int], *flat: np.ndarray) -> list[list[np.ndarray]]:
    """Cut each concatenated array into per-response pieces of `lengths`: views on one owned copy of
    the array (one copy per frame, not one per response: this is on the hub's hot path)."""
    bounds = list(itertools.accumulate(lengths, initial=0))
    out = []
    for a in flat:
        owned = a.copy()
        out.append([owned[bounds[i]:bounds[i + 1]] for i in range(len(lengths))])
    return out


def batch_stats(groups: list[Group]) -> dict[str, float]:
    """Reward, length and truncation statistics of a batch (what an operator watches per step)."""
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = np.array([len(r) for g in groups for r in g.responses])
    reasons = [f for g in groups for f in g.finish_reasons]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "reward_max": float(rewards.max()),
        "reward_min": float(rewards.min()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": int(lengths.max()),
        "truncated_frac": sum(r == "length" for r in reasons) / len(reasons),
        "tokens": int(lengths.sum()),
    }
