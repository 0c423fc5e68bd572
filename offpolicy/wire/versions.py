"""Per-token weight versions, run-length coded: which version produced each token of a response.

With `rollout.inflight_updates` a generation moves to a newer weight version between decode steps, so the
tokens of one response come from several versions. A response's versions travel as runs (`VersionRun(start,
version)`: tokens `start ..` up to the next run's start came from `version`), the first at token 0, starts and
versions strictly increasing: a handful of pairs however long the response. Pure functions, no state:

- `response_runs(switches, length)`: a response's runs from the switches of its generate call (the decode
  step where each version began, the first at 0), cut to the response's length;
- `group_runs(runs_per_response)`: what a `SampleGroup` carries: `(weight_version, version_runs)`, the runs
  left out (`[]`) when every token of the group came from one version;
- `token_versions(runs, length)`: the version of every token, expanded (tests, statistics);
- `check_runs(version_runs, lengths, weight_version, newest)`: why a group's runs are malformed, or None.
"""

from __future__ import annotations

import numpy as np

from offpolicy.wire.protocol import VersionRun


def response_runs(switches: list[tuple[int, int]], length: int) -> list[VersionRun]:
    """The runs of a response of `length` tokens from its generate call's `switches` [(first token index,
    version)], the first at 0: a version that began after the response ended produced none of it."""
    return [VersionRun(start, version) for start, version in switches if start == 0 or start < length]


def group_runs(runs: list[list[VersionRun]]) -> tuple[int, list[list[VersionRun]]]:
    """(weight_version, version_runs) of a group whose responses have `runs`: the oldest version any token
    used, and the runs themselves, or [] when every token came from that one version (the compact message)."""
    oldest = min(r[0].version for r in runs)
    if all(len(r) == 1 and r[0].version == oldest for r in runs):
        return oldest, []
    return oldest, runs


def token_versions(runs: list[VersionRun], length: int) -> np.ndarray:
    """int64 [length]: the version that produced each token of a response with `runs`."""
    out = np.empty(length, dtype=np.int64)
    ends = [r.start for r in runs[1:]] + [length]
    for run, end in zip(runs, ends):
        out[run.start:end] = run.version
    return out


def tokens_after_switch(runs: list[VersionRun], length: int) -> int:
    """Tokens of a response produced by a newer version than its first token's (0 without a switch)."""
    return length - runs[1].start if len(runs) > 1 else 0


def check_runs(version_runs: list[list[VersionRun]], lengths: list[int], weight_version: int,
               newest: int) -> str | None:
    """None if `version_runs` (a SampleGroup's) is well formed for responses of `lengths`, else why not: one
    run list per response, each opening at token 0, starts strictly increasing inside the response,
    versions strictly increasing, none newer than `newest` (the newest version announced), and
    `weight_version` the oldest version of them all."""
    if not version_runs:
        return None
    if len(version_runs) != len(lengths):
        return f"version runs: {len(version_runs)} run lists for {len(lengths)} responses"
    for i, (runs, length) in enumerate(zip(version_runs, lengths)):
        if not runs or runs[0].start != 0:
            return f"version runs: response {i}'s runs do not start at token 0"
        for a, b in zip(runs, runs[1:]):
            if b.start <= a.start or b.version <= a.version:
                return f"version runs: response {i}'s starts and versions are not strictly increasing"
        if runs[-1].start >= length:
            return f"version runs: response {i} has a run starting at token {runs[-1].start} of {length}"
        if runs[-1].version > newest:
            return f"version runs: version {runs[-1].version} was never published (newest {newest})"
    oldest = min(r[0].version for r in version_runs)
    if oldest != weight_version:
        return f"version runs: the oldest version is {oldest}, the group says weight_version {weight_version}"
    return None
