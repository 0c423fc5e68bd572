"""Gaps in a publish's copies (`weights.publish_gap_mib`): a publish queues every copy of a
version on the map stream at once, and a GPU's copy engine runs the ready copies of one stream back to back,
first come first served, whatever the streams' priorities (torchrec's copy-engine studies, meta-pytorch/torchrec
#4303, #4315). A learner's own small device -> host copy queued meanwhile (a MoE dispatcher's split sizes, an `.item()`)
would wait behind the whole version (docs/benchmarks.md, "Does the publish hold the GIL?"), and the step with it. So a
tiny kernel goes on the map stream every `publish_gap_mib` of copies: the next copy is not ready at once, and the engine
takes the other streams' copies in between; a learner's small copy waits for one gap's bytes at most. The map stream has
the highest priority, so those kernels get an SM as soon as one frees.

`CopyGaps(every)` is used by `transfer.write_files` for the copies of one publish into registered maps
(`maps.issue_write`), the steady state of a learner on a GPU. The staged path (files met for the first time)
is left as it was: each of its threads has at most two copies queued, each on a stream of its own.
"""

from __future__ import annotations

import torch

from offpolicy.weights.maps import device_index

_gap_flags: dict[int, torch.Tensor] = {}


class CopyGaps:
    """Tiny kernels between a stream's device -> host copies, one whenever `every` bytes were copied since the
    last (the module doc); `every` 0, or host copies: none. `before(n)` goes right before each copy of
    `n` bytes, on the copies' stream; one `CopyGaps` spans every file of a publish (their copies follow each
    other on one stream). `flag`: the one-byte tensor the kernels write (tests pass a fake)."""

    def __init__(self, every: int, flag=None):
        self.every, self.flag, self.since, self.count = every, flag, 0, 0

    def before(self, n: int, device: torch.device) -> None:
        if self.every <= 0:
            return
        if self.since >= self.every:
            if self.flag is None:
                key = device_index(device)
                self.flag = _gap_flags.get(key)
                if self.flag is None:  # made on the map stream (the caller's current one), kept
                    self.flag = _gap_flags.setdefault(key, torch.zeros(1, dtype=torch.uint8, device=device))
            self.flag.add_(1)  # the gap: a kernel the next copy waits for
            self.since = 0
            self.count += 1
        self.since += n
