"""The prompt cursor and the lease book: who holds which prompts, until when.

Invariants (the hub's accounting and the tests check them):
- Every prompt the cursor hands out is, at any moment, in exactly one place: the cursor's requeue,
  one live lease, or settled (accepted, dropped-and-requeued, or trained). Nothing is lost.
- A prompt is accepted at most once per epoch (`accepted` set), so nothing is trained twice.
- Results for a lease that expired or never existed are refused: the expired lease's prompts went
  back to the requeue and will be (or were) generated again by someone else.
Pure bookkeeping: no sockets, no clocks (callers pass `now`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec


class PromptRef(NamedTuple):
    """One prompt of one epoch. A tuple: hashed and compared in C, which the hub does several times per
    returned group (lease and accepted-set lookups); ordered by (epoch, prompt_id)."""

    epoch: int
    prompt_id: int


class CursorState(msgspec.Struct):
    """The cursor as a checkpoint keeps it (`Hub.snapshot` / `Hub.restore`, offpolicy/learner/checkpoint.py)."""

    epoch: int
    pos: int
    handed_out: int
    first: list[tuple[int, int]]  # (epoch, prompt id) to hand out before the cursor moves on


class PromptCursor:
    """Walks prompt ids epoch by epoch (seeded shuffle per epoch); requeued prompts go first."""

    def __init__(self, num_prompts: int, shuffle: bool = True, seed: int = 0):
        self.num_prompts, self.shuffle, self.seed = num_prompts, shuffle, seed
        self.epoch, self.pos = 0, 0
        self.requeue: deque[PromptRef] = deque()
        self.handed_out = 0  # fresh prompts ever handed out (requeued ones not counted again)
        self.requeued = 0  # prompts given back to be leased again (expired, silent, replaced, stale, refused)
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> list[int] | range:
        if not self.shuffle:
            return range(self.num_prompts)
        order = list(range(self.num_prompts))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def restore(self, epoch: int, pos: int, handed_out: int, first: list[PromptRef]) -> None:
        """Continue a checkpointed walk: the same epoch order and position, `first` handed out first."""
        self.epoch, self.pos, self.handed_out = epoch, pos, handed_out
        self._order = self._make_order(epoch)
        self.requeue = deque(first)

    def take(self, k: int) -> list[PromptRef]:
        out = []
        while len(out) < k and self.requeue:
            out.append(self.requeue.popleft())
        while len(out) < k:
            if self.pos == self.num_prompts:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order(self.epoch)
            out.append(PromptRef(self.epoch, self._order[self.pos]))
            self.pos += 1
            self.handed_out += 1
        return out

    def give_back(self, refs: list[PromptRef]) -> None:
        self.requeue.extend(refs)
        self.requeued += len(refs)


@dataclass
class LeaseRecord:
    lease_id: int
    daemon: str
    min_version: int
    deadline: float
    pending: dict[PromptRef, None] = field(default_factory=dict)  # prompts not yet returned (ordered)


class LeaseBook:
    """Live leases by id, plus the set of (epoch, prompt) already accepted."""

    def __init__(self, first_id: int = 1) -> None:
        self.live: dict[int, LeaseRecord] = {}
        self.accepted: set[PromptRef] = set()
        self._first_id = self._next_id = first_id  # a restarted hub starts elsewhere: old ids stay unknown
        self.issued = 0
        self.expired = 0

    def issue(self, daemon: str, refs: list[PromptRef], min_version: int, deadline: float) -> LeaseRecord:
        rec = LeaseRecord(self._next_id, daemon, min_version, deadline, dict.fromkeys(refs))
        if len(rec.pending) != len(refs):
            raise ValueError("a lease cannot hold the same prompt twice")
        self._next_id += 1
        self.live[rec.lease_id] = rec
        self.issued += 1
        return rec

    def settle(self, lease_id: int, prompt_id: int, epoch: int) -> tuple[str, PromptRef | None]:
        """Take a returned group off its lease: ("ok", ref) or (reason, None) when it must be refused."""
        rec = self.live.get(lease_id)
        if rec is None:
            return ("expired lease" if self._first_id <= lease_id < self._next_id else "unknown lease"), None
        ref = PromptRef(epoch, prompt_id)
        if ref not in rec.pending:
            return "not in lease", None
        if ref in self.accepted:  # cannot happen while the invariants hold; refuse rather than train twice
            return "duplicate", None
        del rec.pending[ref]
        if not rec.pending:
            del self.live[lease_id]
        return "ok", ref

    def mark_accepted(self, ref: PromptRef) -> None:
        self.accepted.add(ref)
        if len(self.accepted) > 4_000_000:  # forget epochs long past
            newest = max(r.epoch for r in self.accepted)
            self.accepted = {r for r in self.accepted if r.epoch >= newest - 1}

    def unaccept(self, ref: PromptRef) -> None:
        """An accepted group was dropped before training (too stale): its prompt may be accepted again."""
        self.accepted.discard(ref)

    def expire(self, now: float, daemon: str | None = None) -> list[PromptRef]:
        """End leases past their deadline (or all of `daemon`'s); returns their unreturned prompts."""
        out: list[PromptRef] = []
        for lid in [lid for lid, r in self.live.items() if r.deadline <= now or r.daemon == daemon]:
            rec = self.live.pop(lid)
            out.extend(rec.pending)
            self.expired += 1
        return out

    def in_flight(self) -> int:
        return sum(len(r.pending) for r in self.live.values())
