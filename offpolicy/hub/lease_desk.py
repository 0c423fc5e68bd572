"""The hub's lease desk: work requests (credits) in, leases out, expired leases back to the cursor.

A rollout's `WorkRequest(credits)` stands (one per connection; the latest replaces it) until the
staleness gate has room; `serve` then answers each standing request with one `Lease` of at most that
many prompts, taken from the cursor and admitted through the gate, recorded in the lease book under
the requesting daemon with the newest version as `min_version` and a deadline `transport.lease_timeout_s`
away (prompt tokens in one array frame). Nothing is leased before a version is published. A lease that
cannot be sent is expired at once. `expire` gives the prompts of expired leases back to the cursor and
the gate, and counts every expiry of the book in `offpolicy_leases_expired_total`. Prompt tokens are
encoded once per prompt (chat template, `data.max_prompt_tokens`: `prompts.PromptEncoder`) and cached.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from offpolicy.config import Config
from offpolicy.data.encoding import PromptEncoder
from offpolicy.hub.admission import StalenessGate, give_back
from offpolicy.hub.leases import LeaseBook, PromptCursor, PromptRef
from offpolicy.plumbing.metrics import LearnerMetrics
from offpolicy.wire import protocol, transport

log = logging.getLogger("offpolicy.hub")

PROMPT_CACHE = 100_000  # encoded prompts kept (a data set larger than that re-encodes the rest)


class Daemon(Protocol):
    daemon_id: str


class LeaseDesk:
    def __init__(self, cfg: Config, dataset, encoder: PromptEncoder, cursor: PromptCursor, gate: StalenessGate,
                 book: LeaseBook, metrics: LearnerMetrics):
        self.cfg, self.dataset, self.encoder, self.m = cfg, dataset, encoder, metrics
        self.cursor, self.gate, self.book = cursor, gate, book
        self.requests: dict[bytes, int] = {}  # standing work requests: identity -> credits
        self._prompt_cache: dict[int, np.ndarray] = {}
        self._expired_counted = 0  # book.expired already exported as offpolicy_leases_expired_total

    def request(self, ident: bytes, credits: int) -> None:
        self.requests[ident] = max(0, credits)

    def forget(self, ident: bytes) -> None:
        """The connection is gone: its standing request with it."""
        self.requests.pop(ident, None)

    async def serve(self, router, peers: Mapping[bytes, Daemon], newest: protocol.WeightAnnouncement | None) -> None:
        """Answer standing work requests while the staleness gate has room."""
        for ident in list(self.requests):
            room = min(self.requests[ident], self.gate.capacity())
            if room <= 0:
                continue
            if newest is None:
                return  # nothing published yet: no version to generate with
            del self.requests[ident]
            refs = self.cursor.take(room)
            self.gate.admit(len(refs))
            rec = self.book.issue(peers[ident].daemon_id, refs, newest.version,
                                  time.monotonic() + self.cfg.transport.lease_timeout_s)
            tokens = [self.prompt_tokens(r.prompt_id) for r in refs]
            rows = [self.dataset[r.prompt_id] for r in refs]
            prompts = [protocol.LeasePrompt(r.prompt_id, r.epoch, len(t), row.text, row.answer, row.data_source)
                       for r, t, row in zip(refs, tokens, rows)]
            lease = protocol.Lease(lease_id=rec.lease_id, min_version=rec.min_version,
                                   deadline_s=self.cfg.transport.lease_timeout_s, prompts=prompts)
            self.m.leases_issued.inc()
            self.m.prompts_leased.inc(len(refs))
            if not await transport.send(router, lease, np.concatenate(tokens), to=ident):
                self.expire(self.book.expire(float("inf"), daemon=rec.daemon))
        self.m.in_flight.set(self.book.in_flight())

    def prompt_tokens(self, prompt_id: int) -> np.ndarray:
        tokens = self._prompt_cache.get(prompt_id)
        if tokens is None:
            tokens = np.asarray(self.encoder.encode(self.dataset[prompt_id], prompt_id), dtype=protocol.TOKEN_DTYPE)
            if len(self._prompt_cache) < PROMPT_CACHE:
                self._prompt_cache[prompt_id] = tokens
        return tokens

    def expire(self, refs: list[PromptRef]) -> None:
        """Count the book's expiries and give `refs` (prompts of expired leases) back to the cursor."""
        self.m.leases_expired.inc(self.book.expired - self._expired_counted)  # every path that expires counts
        self._expired_counted = self.book.expired
        if refs:
            give_back(self.cursor, self.gate, refs)
            log.warning("%d prompts returned to the queue from expired leases", len(refs))
