"""Token-budget dynamic batching: a step's responses cut into right-padded micro-batches per DP rank.

A row is one response with its prompt. `plan` sorts rows by length (longest first) and fills
micro-batches greedily so that rows x padded length <= `max_tokens` (a row longer than the budget
gets a micro-batch of its own); with `max_tokens = 0` a micro-batch is `rows_per_micro` rows. The
micro-batches are dealt round-robin to the `dp` data-parallel ranks; ranks left short get an empty
micro-batch (one pad token, mask 0) so every rank runs the same schedule. `pack` builds the tensors
of one micro-batch, its length rounded up to a multiple of tp under sequence parallelism (the
budget counts unrounded lengths). Right padding under a causal mask is exact: a real token never sees a pad.
Invariant: every response of the step is in exactly one micro-batch of exactly one DP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from offpolicy.batch import Group


@dataclass
class Row:
    prompt: np.ndarray
    response: np.ndarray
    logprobs: np.ndarray
    advantage: float

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)


def rows_of(groups: list[Group], advantages: torch.Tensor) -> list[Row]:
    return [Row(g.prompt, r, lp, float(advantages[i, j]))
            for i, g in enumerate(groups) for j, (r, lp) in enumerate(zip(g.responses, g.logprobs))]


def plan(rows: list[Row], dp: int, *, max_tokens: int, rows_per_micro: int) -> list[list[list[Row]]]:
    """Micro-batches of rows for each DP rank: `[dp][micro][row]`, the same count on every rank."""
    order = sorted(rows, key=lambda r: r.length, reverse=True)
    micros: list[list[Row]] = []
    for row in order:
        cur = micros[-1] if micros else None
        if cur is not None and (_fits(cur, row, max_tokens) if max_tokens else len(cur) < rows_per_micro):
            cur.append(row)
        else:
            micros.append([row])
    while len(micros) < dp and any(len(m) > 1 for m in micros):  # split so that every rank has work
        big = max(range(len(micros)), key=lambda i: len(micros[i]))
        half = len(micros[big]) // 2
        micros[big:big + 1] = [micros[big][:half], micros[big][half:]]
    per_rank = -(-len(micros) // dp)
    empty = Row(np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), 0.0)
    out = [[micros[i] for i in range(r, len(micros), dp)] for r in range(dp)]
    return [m + [[empty]] * (per_rank - len(m)) for m in out]


def _fits(micro: list[Row], row: Row, max_tokens: int) -> bool:
    width = max(micro[0].length, row.length)  # rows arrive longest first
    return (len(micro) + 1) * width <= max_tokens


def padded(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def pack(rows: list[Row], device: torch.device, dtype: torch.dtype = torch.float32,
         multiple: int = 1) -> dict[str, torch.Tensor]:
    """ids/positions `[b, s]`; per response: tokens, old logprobs, mask, logit index `[b, r]`; adv `[b]`.

    The padded length `s` is a multiple of `multiple` (tp under sequence parallelism)."""
    b = len(rows)
    width = padded(max(r.length for r in rows), multiple)
    rmax = max(max(len(r.response) for r in rows), 1)
    ids = torch.zeros((b, width), dtype=torch.long)
    resp = torch.zeros((b, rmax), dtype=torch.long)
    old = torch.zeros((b, rmax), dtype=dtype)
    mask = torch.zeros((b, rmax), dtype=dtype)
    index = torch.zeros((b, rmax), dtype=torch.long)
    adv = torch.tensor([r.advantage for r in rows], dtype=dtype)
    for i, r in enumerate(rows):
        n_p, n_r = len(r.prompt), len(r.response)
        ids[i, :n_p] = torch.from_numpy(r.prompt.astype("int64"))
        ids[i, n_p:n_p + n_r] = torch.from_numpy(r.response.astype("int64"))
        resp[i, :n_r] = ids[i, n_p:n_p + n_r]
        old[i, :n_r] = torch.from_numpy(r.logprobs.astype("float32")).to(dtype)
        mask[i, :n_r] = 1
        index[i] = (torch.arange(rmax) + n_p - 1).clamp(min=0, max=width - 1)
    positions = torch.arange(width).expand(b, -1).contiguous()
    t = dict(ids=ids, positions=positions, resp=resp, old=old, mask=mask, index=index, adv=adv)
    return {k: v.to(device) for k, v in t.items()}
