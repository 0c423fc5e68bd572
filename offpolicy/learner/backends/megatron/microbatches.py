"""How many micro-batches a pipeline-parallel step is cut into (`learner.megatron.pp_microbatches`).

Megatron's 1F1B schedule keeps each of `pp` stages idle for `pp - 1` of the `M + pp - 1` micro-batch slots of a
step with `M` micro-batches on a data-parallel rank: the bubble, `(pp - 1) / (M + pp - 1)` of the step (`bubble`).
A token budget that fills the GPU (`max_tokens_per_gpu`) can hold a rank's whole share of a step in one or two
micro-batches; then a second stage adds memory but little speed (the GPT-OSS slice's PP2 x EP2 on 4 GPUs, with 2
micro-batches a rank, ran barely faster than EP2 alone on 2: docs/megatron.md, "Speed"). So with `pp > 1` the budget is
lowered until a rank's share fills at least `minimum` micro-batches: `auto` = 4 per stage (pp 2: 8, a bubble of 1/9; pp
4: 16, 3/19), never below the longest row (a row is never split). Pure functions: the learner (backend.py) and the
planner (plan/memory.py) cut a step the same way.
"""

from __future__ import annotations

import math

PER_STAGE = 4  # auto: micro-batches per pipeline stage


def minimum(setting: int | str, pp: int) -> int:
    """The fewest micro-batches a data-parallel rank's share of a step is cut into (`learner.megatron.
    pp_microbatches`): 1 without pipeline parallelism, else the setting (`auto`: PER_STAGE x pp)."""
    if pp <= 1:
        return 1
    return PER_STAGE * pp if setting == "auto" else max(1, int(setting))


def budget(tokens_per_rank: float, max_tokens: float, fewest: int, longest: float) -> float:
    """The token budget of one micro-batch that cuts `tokens_per_rank` into at least `fewest` micro-batches:
    `max_tokens` lowered to ceil(tokens_per_rank / fewest), never below `longest` (the longest row). `max_tokens`
    0 (micro-batches counted in groups, `learner.micro_batch_groups`) stays 0."""
    if fewest <= 1 or max_tokens <= 0 or tokens_per_rank <= 0:
        return max_tokens
    return max(longest, min(max_tokens, math.ceil(tokens_per_rank / fewest)))


def bubble(pp: int, micro: int) -> float:
    """The 1F1B schedule's idle share of a step with `micro` micro-batches a rank over `pp` stages."""
    return (pp - 1) / (max(1, micro) + pp - 1)
