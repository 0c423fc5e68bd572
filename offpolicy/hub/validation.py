"""Checks a returned sample group must pass before the hub accepts it. Pure: no state, no sockets.

`check_group` returns None for a good group, or a short reason (the metric label comes before any
colon) for one the hub must refuse: wrong group size, responses empty or over the length limit,
token ids outside the vocabulary, non-finite or positive logprobs, non-finite rewards, unknown
finish reasons, a weight version outside [lease minimum, newest published], or malformed per-token version
runs (`wire.versions.check_runs`: out of order, outside a response, newer than announced, or an oldest version
that is not the group's `weight_version`). The group's `weight_version` is its oldest token's, so the lease
minimum and the staleness bound hold for every token.
"""

from __future__ import annotations

import math

import numpy as np

from offpolicy.wire.protocol import SampleGroup
from offpolicy.wire.versions import check_runs

FINISH_REASONS = ("stop", "length")
_FINISH_SET = frozenset(FINISH_REASONS)


def check_group(msg: SampleGroup, arrays: list[np.ndarray], *, n_samples: int, max_new_tokens: int,
                vocab_size: int, min_version: int | None, newest_version: int) -> str | None:
    prompt, tokens, logprobs = arrays
    if len(msg.response_lengths) != n_samples:
        return f"group size: {len(msg.response_lengths)} responses, expected {n_samples}"
    if min(msg.response_lengths) < 1 or max(msg.response_lengths) > max_new_tokens:
        return f"response length: outside 1..{max_new_tokens}"
    for a in (prompt, tokens):
        if a.size and not _ids_below(a, vocab_size):
            return f"token id: outside the vocabulary of {vocab_size}"
    # NaN propagates through min and max, and fails both comparisons: two passes, no temporaries
    if logprobs.size and not (logprobs.min() > -np.inf and logprobs.max() <= 1e-3):
        return "logprob: non-finite or positive"
    if not all(map(math.isfinite, msg.rewards)):
        return "reward: non-finite"
    if not _FINISH_SET.issuperset(msg.finish_reasons):
        return f"finish reason: not one of {FINISH_REASONS}"
    if min_version is not None and msg.weight_version < min_version:
        return f"version: {msg.weight_version} is below the lease minimum {min_version}"
    if msg.weight_version > newest_version:
        return f"version: {msg.weight_version} was never published (newest {newest_version})"
    return check_runs(msg.runs_of, msg.response_lengths, msg.weight_version, newest_version)


def _ids_below(a: np.ndarray, vocab_size: int) -> bool:
    """All ids in [0, vocab_size). For int32 (the wire's dtype) one pass: as unsigned, a negative id is huge."""
    if a.dtype == np.int32:  # native byte order
        return int(a.view(np.uint32).max()) < vocab_size
    return int(a.min()) >= 0 and int(a.max()) < vocab_size
