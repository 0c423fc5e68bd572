"""In-memory sample groups as the learner holds them, and their reduction to step statistics.

A `Group` is one prompt's `n` responses as received from a rollout (decoded from a `SampleGroup`
message and its array frames); a training batch is a list of groups. The hub keeps the received
ZeroMQ frames as the group's storage: its arrays are writable views on them (a frame received with
`copy=False` is the message's own memory, which ZeroMQ never reuses while a view holds it), so
nothing is copied on the hub's hot path; an array on read-only memory is copied once.

With in-flight weight updates a response's tokens come from several versions (`version_runs`, run-length coded
as on the wire); `weight_version` is then the oldest of them, the one the staleness bound is checked against,
and `version_stats` reduces a batch's per-token versions to step statistics.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from offpolicy.wire.protocol import VersionRun
from offpolicy.wire.versions import token_versions, tokens_after_switch


@dataclass
class Group:
    prompt_id: int
    epoch: int
    lease_id: int
    weight_version: int  # oldest version any token of the responses was generated with
    prompt: np.ndarray  # int32 prompt tokens
    responses: list[np.ndarray]  # int32 tokens per response
    logprobs: list[np.ndarray]  # float32 behaviour logprobs per response
    rewards: np.ndarray  # float64 [n]
    finish_reasons: list[str]
    daemon: str = ""
    gen_seconds: float = 0.0  # wall time of the rollout's generate call this group came from
    version_runs: list[list[VersionRun]] = field(default_factory=list)  # per response; [] = all weight_version

    @property
    def n(self) -> int:
        return len(self.responses)

    @property
    def newest_version(self) -> int:
        """The newest version any token of the group was generated with."""
        return max(r[-1].version for r in self.version_runs) if self.version_runs else self.weight_version

    def token_versions(self) -> list[np.ndarray]:
        """The version of every token, per response."""
        if not self.version_runs:
            return [np.full(len(r), self.weight_version, dtype=np.int64) for r in self.responses]
        return [token_versions(runs, len(r)) for runs, r in zip(self.version_runs, self.responses)]

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


def version_stats(groups: list[Group], step: int) -> dict[str, float]:
    """Per-token versions of the batch trained by step `step`: the tokens' staleness (step - version: mean,
    max, min), and the fraction of tokens and of responses generated after an in-flight switch (by a newer
    version than their response's first token)."""
    staleness = step - np.concatenate([v for g in groups for v in g.token_versions()])
    switched = sum(tokens_after_switch(runs, len(r)) for g in groups for runs, r in zip(g.version_runs, g.responses))
    responses = sum(g.n for g in groups)
    switched_responses = sum(len(runs) > 1 for g in groups for runs in g.version_runs)
    return {
        "token_staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
        "token_staleness_max": int(staleness.max()) if staleness.size else 0,
        "token_staleness_min": int(staleness.min()) if staleness.size else 0,
        "switched_token_frac": switched / max(staleness.size, 1),
        "switched_response_frac": switched_responses / max(responses, 1),
    }


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
