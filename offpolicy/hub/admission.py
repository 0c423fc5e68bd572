"""The staleness gate and the batcher: how one-step-off is enforced.

Rules (DESIGN.md, "One-step-off, exactly"), with B = batch groups, s = max_staleness, V = newest
published version (= optimizer steps done):
- A sample generated with version g may be trained by step k only if k - g <= s.
- Admission: groups ever admitted (leased and not given back) stay <= (V + s + 1) * B. Leases carry
  `min_version = V`, so every admitted group is generated with a version >= V and is consumed by
  step V + s at the latest; at most (s + 1) * B groups are ever in flight beyond what was trained.
  s = 0 therefore admits exactly one batch per version: a synchronous GRPO loop.
- The batcher takes the B oldest-version groups for step k; a group that is too stale anyway (a slow
  server) is dropped, counted and its prompt given back for regeneration, never trained on
  (`drop_stale`: the one implementation the hub runs and the simulation in the tests checks).
Pure logic: no sockets, no clocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from offpolicy.hub.batch import Group
from offpolicy.hub.leases import LeaseBook, PromptCursor, PromptRef


@dataclass
class StalenessGate:
    batch_groups: int
    max_staleness: int
    version: int = 0  # newest published version
    admitted: int = 0  # groups admitted and not given back

    def capacity(self) -> int:
        """How many more groups may be leased now."""
        return max(0, (self.version + self.max_staleness + 1) * self.batch_groups - self.admitted)

    def admit(self, k: int) -> None:
        if k > self.capacity():
            raise ValueError(f"admitting {k} groups exceeds the capacity {self.capacity()}")
        self.admitted += k

    def give_back(self, k: int) -> None:
        self.admitted -= k

    def usable(self, gen_version: int, step: int) -> bool:
        return step - gen_version <= self.max_staleness


class Batcher:
    """Buffers accepted groups; hands out B groups per step, oldest weight version first and in
    arrival order within a version. Groups are kept per version, so taking a batch or dropping the
    stale ones costs O(B + versions), not O(buffer): the hub runs this on every step."""

    def __init__(self, gate: StalenessGate):
        self.gate = gate
        self._by_version: dict[int, deque[tuple[int, Group]]] = {}  # version -> (arrival number, group)
        self._arrivals = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def buffer(self) -> list[Group]:
        """Every buffered group, in arrival order."""
        entries = [e for q in self._by_version.values() for e in q]
        return [g for _, g in sorted(entries, key=_arrival)]

    def add(self, group: Group) -> None:
        q = self._by_version.get(group.weight_version)
        if q is None:
            q = self._by_version[group.weight_version] = deque()
        q.append((self._arrivals, group))
        self._arrivals += 1
        self._count += 1

    def drop_stale(self, step: int) -> list[Group]:
        """Remove and return (in arrival order) the groups step `step` may no longer train on."""
        old = [v for v in self._by_version if not self.gate.usable(v, step)]
        entries = sorted((e for v in old for e in self._by_version.pop(v)), key=_arrival)
        self._count -= len(entries)
        return [g for _, g in entries]

    def take(self, step: int) -> list[Group] | None:
        """B groups for step `step`, or None while fewer are buffered (call drop_stale first)."""
        b = self.gate.batch_groups
        if self._count < b:
            return None
        batch: list[Group] = []
        for v in sorted(self._by_version):
            q = self._by_version[v]
            while q and len(batch) < b:
                batch.append(q.popleft()[1])
            if not q:
                del self._by_version[v]
            if len(batch) == b:
                break
        self._count -= b
        return batch


def _arrival(entry: tuple[int, Group]) -> int:
    return entry[0]


def give_back(cursor: PromptCursor, gate: StalenessGate, refs: list[PromptRef]) -> None:
    """Prompts that will not be trained as they are (refused, stale, expired): regenerate them."""
    cursor.give_back(refs)
    gate.give_back(len(refs))


def drop_stale(batcher: Batcher, book: LeaseBook, cursor: PromptCursor, step: int) -> list[Group]:
    """Drop the buffered groups step `step` may no longer train on and give their prompts back: they
    are no longer accepted (the regenerated group may be) and go to the front of the cursor."""
    stale = batcher.drop_stale(step)
    if stale:
        refs = [PromptRef(g.epoch, g.prompt_id) for g in stale]
        for ref in refs:
            book.unaccept(ref)
        give_back(cursor, batcher.gate, refs)
    return stale
