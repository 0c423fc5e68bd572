"""What a vLLM worker's requests have sampled so far: the split point of a weight update in flight.

While a server is paused with `mode="keep"` (its requests stay, frozen between two steps), each worker's model runner
holds every running request's sampled tokens; a version loaded during that pause produces the tokens after them. Read
on vLLM 0.26 (V2 runner, an H200) and 0.32 (V1 runner, the CPU): the counts are exactly the start of each finished
output (`benchmarks/vllm_inflight_probe.py`, docs/benchmarks.md). Pure functions over the runner's state:

- `sampled(runner)`: every request the runner holds -> the token ids it has sampled (`sampled_lengths`: how many);
- `sample_key(vllm_id)`: our request id and sample index from vLLM's id of one sample: `<k>_generate-tokens-<ours>-<8
  hex>` for a request of n > 1 samples over the tokens API (the engine adds `<k>_`, the API its prefix, the input
  processor the suffix: 0.26 and 0.32), without `<k>_` for one sample, without the prefix in process.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^(?:(\d+)_)?(?:[a-z-]*?)(offpolicy-[0-9a-f]+-\d+)(?:-[0-9a-f]{8})?$")


def sampled(runner) -> dict[str, list[int]]:
    """Request id -> the token ids it has sampled, from a vLLM model runner: V1's `requests[id].output_token_ids`, or
    V2's `req_states` (the GPU default from 0.2x): row `req_id_to_index[id]` of `all_token_ids`, the prompt's
    `prompt_len` tokens then the sampled ones up to `total_len` (`_v2_rows`)."""
    requests = getattr(runner, "requests", None)
    if requests is not None:
        return {rid: [int(t) for t in state.output_token_ids] for rid, state in requests.items()}
    states = _v2_states(runner)
    return {rid: [int(t) for t in states.all_token_ids.gpu[row, start:end].tolist()]
            for rid, row, start, end in _v2_rows(states)}


def sampled_lengths(runner) -> dict[str, int]:
    """Request id -> how many tokens it has sampled (`sampled`'s lengths, without reading the tokens: what a weight
    update in flight asks during its pause)."""
    requests = getattr(runner, "requests", None)
    if requests is not None:
        return {rid: len(state.output_token_ids) for rid, state in requests.items()}
    return {rid: end - start for rid, _, start, end in _v2_rows(_v2_states(runner))}


def _v2_states(runner):
    states = getattr(runner, "req_states", None)
    if states is None:
        raise TypeError(f"{type(runner).__name__} has neither `requests` (vLLM's V1 runner) nor `req_states` (V2): "
                        "this vLLM keeps its requests elsewhere; set rollout.inflight_updates=false")
    return states


def _v2_rows(states) -> list[tuple[str, int, int, int]]:
    """(request id, row, first sampled token's index, end) of each request of a V2 runner's `req_states`; `total_len`
    is written on the GPU as tokens are sampled, so it is read once, after the device is synchronised."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    total = states.total_len.gpu.cpu()
    return [(rid, row, int(states.prompt_len.np[row]), int(total[row])) for rid, row in states.req_id_to_index.items()]


def sample_key(vllm_id: str) -> tuple[str, int] | None:
    """(our request id, sample index) of one of vLLM's sample ids, or None for a request not ours."""
    m = _SAMPLE.match(vllm_id)
    return None if m is None else (m.group(2), int(m.group(1) or 0))


def counts(progress: dict[str, int]) -> dict[tuple[str, int], int]:
    """A worker's {vLLM sample id: tokens sampled} by (our request id, sample index); others' requests left out."""
    out = {}
    for vllm_id, n in progress.items():
        key = sample_key(vllm_id)
        if key is not None:
            out[key] = int(n)
    return out
