"""In-memory sample groups as the learner holds them, and their reduction to step statistics.

A `Group` is one prompt's `n` responses as received from a rollout (decoded from a `SampleGroup`
message and its array frames); a training batch is a list of groups. The hub keeps the received
ZeroMQ frames as the group's storage: its arrays are writable views on them (a frame received with
`copy=False` is the message's own memory, which ZeroMQ never reuses while a view holds it), so
nothing is copied on the hub's hot path; an array on read-only memory is copied once.
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
    gen_seconds: float = 0.0  # wall time of the rollout's generate call this group came from

    @property
    def n(self) -> int:
        return len(self.responses)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


def split_frames(lengths: list[int], *flat: np.ndarray) -> list[list[np.ndarray]]:
    """Cut each concatenated array into per-response pieces of `lengths`: views on the array (on a
    copy of it only if it is read-only, so the learner may always write into what it is given)."""
    bounds = list(itertools.accumulate(lengths, initial=0))
    cuts = list(zip(bounds, bounds[1:]))
    out = []
    for a in flat:
        if not a.flags.writeable:
            a = a.copy()
        out.append([a[i:j] for i, j in cuts])
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
        # the time split's generate share: one generate call (a lease's groups at once), mean over the groups
        "generate_seconds": float(np.mean([g.gen_seconds for g in groups])),
    }
