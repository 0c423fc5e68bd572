"""The staleness gate and the batcher: how one-step-off is enforced.

Rules (DESIGN.md, "One-step-off, exactly"), with B = batch groups, s = max_staleness, V = newest
published version (= optimizer steps done):
- A sample generated with version g may be trained by step k only if k - g <= s.
- Admission: groups ever admitted (leased and not given back) stay <= (V + s + 1) * B. Leases carry
  `min_version = V`, so every admitted group is generated with a version >= V and is consumed by
  step V + s at the latest; at most (s + 1) * B groups are ever in flight beyond what was trained.
  s = 0 therefore admits exactly one batch per version: a synchronous GRPO loop.
- The batcher takes the B oldest-version groups for step k; a group that is too stale anyway (a slow
  server) is dropped, counted and its prompt given back for regeneration, never trained on.
Pure logic: no sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from offpolicy.batch import Group


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
    """Buffers accepted groups; hands out B groups per step, oldest weight version first."""

    def __init__(self, gate: StalenessGate):
        self.gate = gate
        self.buffer: list[Group] = []

    def add(self, group: Group) -> None:
        self.buffer.append(group)

    def drop_stale(self, step: int) -> list[Group]:
        """Remove and return the groups step `step` may no longer train on."""
        stale = [g for g in self.buffer if not self.gate.usable(g.weight_version, step)]
        if stale:
            self.buffer = [g for g in self.buffer if self.gate.usable(g.weight_version, step)]
        return stale

    def take(self, step: int) -> list[Group] | None:
        """B groups for step `step`, or None while fewer are buffered (call drop_stale first)."""
        b = self.gate.batch_groups
        if len(self.buffer) < b:
            return None
        order = sorted(range(len(self.buffer)), key=lambda i: (self.buffer[i].weight_version, i))
        chosen = set(order[:b])
        batch = [self.buffer[i] for i in sorted(chosen, key=lambda i: (self.buffer[i].weight_version, i))]
        self.buffer = [g for i, g in enumerate(self.buffer) if i not in chosen]
        return batch
