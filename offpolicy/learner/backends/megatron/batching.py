"""Token-budget dynamic batching: a step's responses cut into micro-batches per DP rank, padded or packed.

A row is one response with its prompt. Padded (`packed=False`): `plan` sorts rows by length (longest
first) and fills micro-batches greedily so that rows x padded length <= `max_tokens`; `pad` builds
`[b, s]` right-padded tensors (exact under a causal mask: a real token never sees a pad). Packed
(`packed=True`): `plan` puts rows first-fit-decreasing into micro-batches whose summed lengths stay
<= `max_tokens`; `concat` lays them end to end in one row `[1, T]`, positions restarting at 0 in every
row, with the document bounds that the core attention masks by (no token sees another document). A
row longer than the budget gets a micro-batch of its own; with `max_tokens = 0` a micro-batch is
`rows_per_micro` rows. Micro-batches are dealt round-robin to the `dp` ranks; ranks left short get an
empty micro-batch (one pad token, no response) so every rank runs the same schedule. Under sequence
parallelism the length is rounded up to a multiple of tp (packed: a pad document at the end).

Both layouts give the loss the same response tensors: old logprobs and mask `[b, r]`, advantages
`[b]`, and for the N real response tokens `tok` (the token), `sel` (the row of the flattened `[s, b]`
hidden states whose logits predict it, megatron's sequence-first order) and `slot` (its place in the
flattened `[b, r]` grid). Invariant: every response of the step is in exactly one micro-batch of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from offpolicy.hub.batch import Group


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
    adv = advantages.tolist()  # one conversion, not a tensor index per response
    return [Row(g.prompt, r, lp, float(adv[i][j]))
            for i, g in enumerate(groups) for j, (r, lp) in enumerate(zip(g.responses, g.logprobs))]


def plan(rows: list[Row], dp: int, *, max_tokens: int, rows_per_micro: int,
         packed: bool = False) -> list[list[list[Row]]]:
    """Micro-batches of rows for each DP rank: `[dp][micro][row]`, the same count on every rank."""
    order = sorted(rows, key=lambda r: r.length, reverse=True)
    micros: list[list[Row]] = []
    if packed and max_tokens:
        room: list[int] = []
        for row in order:  # first fit, longest first
            at = next((i for i, free in enumerate(room) if free >= row.length), None)
            if at is None:
                micros.append([row])
                room.append(max_tokens - row.length)
            else:
                micros[at].append(row)
                room[at] -= row.length
    else:
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


def tokens(micro: list[Row], *, packed: bool, multiple: int = 1) -> int:
    """Token slots the model processes for this micro-batch (padding included)."""
    if packed:
        return padded(sum(r.length for r in micro), multiple)
    return len(micro) * padded(max(r.length for r in micro), multiple)


def pad(rows: list[Row], device: torch.device, dtype: torch.dtype = torch.float32,
        multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded ids/positions `[b, s]` (s a multiple of `multiple`) and the response tensors."""
    b, width = len(rows), padded(max(r.length for r in rows), multiple)
    ids = np.zeros((b, width), np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r.prompt)], ids[i, len(r.prompt):r.length] = r.prompt, r.response
    positions = np.broadcast_to(np.arange(width), (b, width)).copy()
    # the logit of response token j of row i sits at position len(prompt) - 1 + j, flat index pos * b + i
    at = [(len(r.prompt) - 1) * b + i for i, r in enumerate(rows)]
    return _on(device, **_responses(rows, at, b, dtype), ids=ids, positions=positions)


def concat(rows: list[Row], device: torch.device, dtype: torch.dtype = torch.float32,
           multiple: int = 1) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The rows end to end as one row `[1, T]` (T a multiple of `multiple`), positions restarting per row,
    the response tensors, and the document bounds [0, ..., T] (a trailing pad is a document of its own).
    On a GPU the index tensors are made there (`_concat_on_device`), else by numpy (`concat_host`)."""
    if device.type == "cuda":
        return _concat_on_device(rows, device, dtype, multiple)
    return concat_host(rows, device, dtype, multiple)


def concat_host(rows: list[Row], device: torch.device, dtype: torch.dtype = torch.float32,
                multiple: int = 1) -> tuple[dict[str, torch.Tensor], list[int]]:
    """`concat` by numpy on the host, then copied to `device`."""
    bounds = _bounds(rows, multiple)
    total = bounds[-1]
    ids = np.zeros(total, np.int64)
    ids[:bounds[len(rows)]] = np.concatenate([part for r in rows for part in (r.prompt, r.response)])
    starts = np.asarray(bounds[:-1], np.int64)
    positions = np.arange(total, dtype=np.int64) - np.repeat(starts, np.diff(bounds))
    at = [a + len(r.prompt) - 1 for r, a in zip(rows, bounds)]
    return _on(device, **_responses(rows, at, 1, dtype), ids=ids[None], positions=positions[None]), bounds


def _bounds(rows: list[Row], multiple: int) -> list[int]:
    bounds = [0, *np.cumsum([r.length for r in rows]).tolist()]
    total = padded(bounds[-1], multiple)
    if total > bounds[-1]:
        bounds.append(total)
    return bounds


def _concat_on_device(rows: list[Row], device: torch.device, dtype: torch.dtype = torch.float32,
                      multiple: int = 1) -> tuple[dict[str, torch.Tensor], list[int]]:
    """`concat_host`'s tensors, equal to them, made on `device` from what only the host has: the documents'
    and responses' lengths, the tokens, the old logprobs and the advantages, gathered into one (pinned, on a
    GPU) buffer and copied in one transfer; positions, the response indices (`_responses`' within, slot, sel),
    tok (the token after sel: ids[sel + 1]) and the old / mask grids are then a few device ops, not numpy passes
    over every token on the host while the GPU waits at the step's start (docs/benchmarks.md)."""
    bounds = _bounds(rows, multiple)
    b, total, real = len(rows), bounds[-1], bounds[len(rows)]
    prompt = np.fromiter((len(r.prompt) for r in rows), np.int64, b)
    n = np.fromiter((len(r.response) for r in rows), np.int64, b)
    count, rmax = int(n.sum()), max(int(n.max(initial=0)), 1)
    docs = np.diff(np.asarray(bounds, np.int64))  # every document's length, the trailing pad's too
    parts = dict(docs=(docs, len(docs)), prompt=(prompt, b), n=(n, b),
                 tokens=(np.int32, real), old=(np.float32, count),
                 adv=(np.array([r.advantage for r in rows], np.float64), b))
    layout, size = {}, 0
    for k, (v, length) in parts.items():
        kind = np.dtype(v if isinstance(v, type) else v.dtype)
        layout[k] = (size, kind, length)
        size += -(-length * kind.itemsize // 8) * 8  # every part 8-byte aligned
    host = torch.empty(max(size, 8), dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy()

    def view(k: str) -> np.ndarray:
        at, kind, length = layout[k]
        return raw[at:at + length * kind.itemsize].view(kind)

    for k in ("docs", "prompt", "n", "adv"):
        view(k)[:] = parts[k][0]
    if real:
        np.concatenate([part for r in rows for part in (r.prompt, r.response)], out=view("tokens"), casting="unsafe")
    if count:
        np.concatenate([r.logprobs for r in rows], out=view("old"), casting="unsafe")
    dev = host.to(device, non_blocking=True)

    def on(k: str) -> torch.Tensor:
        at, kind, length = layout[k]
        return dev[at:at + length * kind.itemsize].view(_TORCH[kind.str])

    docs_t, prompt_t, n_t = on("docs"), on("prompt"), on("n")
    ids = torch.zeros(total, dtype=torch.int64, device=device)
    ids[:real] = on("tokens")
    starts = torch.cumsum(docs_t, 0) - docs_t
    positions = torch.arange(total, device=device) - torch.repeat_interleave(starts, docs_t, output_size=total)
    first = torch.cumsum(n_t, 0) - n_t  # each response's first token among the N
    within = torch.arange(count, device=device) - torch.repeat_interleave(first, n_t, output_size=count)
    slot = torch.repeat_interleave(torch.arange(b, device=device) * rmax, n_t, output_size=count) + within
    sel = torch.repeat_interleave(starts[:b] + prompt_t - 1, n_t, output_size=count) + within
    tok = ids[sel + 1]
    old = torch.zeros(b * rmax, dtype=torch.float32, device=device).index_copy_(0, slot, on("old"))
    mask = torch.zeros(b * rmax, dtype=torch.float32, device=device).index_fill_(0, slot, 1.0)
    old, mask = old.view(b, rmax).to(dtype), mask.view(b, rmax).to(dtype)
    adv = on("adv").to(dtype)
    return dict(old=old, mask=mask, adv=adv, tok=tok, sel=sel, slot=slot, ids=ids[None],
                positions=positions[None]), bounds


_TORCH = {"<i8": torch.int64, "<i4": torch.int32, "<f4": torch.float32, "<f8": torch.float64}


def _on(device: torch.device, **arrays: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
    """The host arrays as tensors on `device`. The host side is numpy throughout: torch's CPU ops on these
    small tensors run on its OpenMP pool, whose wake-ups on a busy many-core host left the GPU waiting at a
    step's start (docs/benchmarks.md)."""
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v).to(device, non_blocking=True)
            for k, v in arrays.items()}


def _responses(rows: list[Row], at: list[int], stride: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """old/mask `[b, r]`, adv `[b]`; tok/sel/slot `[N]` over the N real response tokens (vectorised over the
    rows: a loop of per-row aranges cost ~30 us a response).

    `at[i]` is the flat hidden-state index of row i's first response logit; the next is `stride` further."""
    b = len(rows)
    n = np.fromiter((len(r.response) for r in rows), np.int64, b)
    rmax = max(int(n.max(initial=0)), 1)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # a token's place in its response
    slot = np.repeat(np.arange(b) * rmax, n) + within
    sel = np.repeat(np.asarray(at, np.int64), n) + stride * within
    tok = np.concatenate([r.response for r in rows]).astype(np.int64)
    old = np.zeros(b * rmax, np.float32)
    old[slot] = np.concatenate([r.logprobs for r in rows])
    mask = np.zeros(b * rmax, np.float32)
    mask[slot] = 1
    adv = torch.from_numpy(np.array([r.advantage for r in rows], np.float64)).to(dtype)
    old_t, mask_t = torch.from_numpy(old.reshape(b, rmax)), torch.from_numpy(mask.reshape(b, rmax))
    if dtype != torch.float32:
        old_t, mask_t = old_t.to(dtype), mask_t.to(dtype)
    return dict(old=old_t, mask=mask_t, adv=adv, tok=tok, sel=sel, slot=slot)
