"""The hub's intake of returned sample groups: check, settle, buffer, acknowledge, count.

`take` checks a `SampleGroup` (`validation.check_group`, against its lease's `min_version` and the
newest version), settles it in the lease book (an unknown lease, a prompt not in it, a duplicate are
refused), compares its prompt tokens with the lease's, and refuses it if the staleness gate says no
step may train on it any more (counted in `stale`). A refused group's live prompt goes back to the
cursor to be generated elsewhere; an accepted one joins the batcher with its received frames as
storage. Outcomes and counters gather over one receive batch: `flush` counts the batch's groups,
samples and tokens once and returns one list of outcomes (one `Ack`) per rollout.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from offpolicy.config import Config
from offpolicy.hub.admission import Batcher, StalenessGate, give_back
from offpolicy.hub.batch import Group, split_frames
from offpolicy.hub.leases import LeaseBook, PromptCursor
from offpolicy.hub.validation import check_group
from offpolicy.plumbing.logs import RateLimitedLog
from offpolicy.plumbing.metrics import LearnerMetrics
from offpolicy.wire import protocol


class Intake:
    def __init__(self, cfg: Config, vocab_size: int, book: LeaseBook, cursor: PromptCursor, gate: StalenessGate,
                 batcher: Batcher, metrics: LearnerMetrics, rate_log: RateLimitedLog,
                 prompt_tokens: Callable[[int], np.ndarray]):
        self.cfg, self.vocab_size, self.m, self.rate_log = cfg, vocab_size, metrics, rate_log
        self.book, self.cursor, self.gate, self.batcher = book, cursor, gate, batcher
        self.prompt_tokens = prompt_tokens  # a prompt's tokens as its lease carried them
        self.stale = 0  # groups refused as too stale on arrival
        self._outcomes: dict[bytes, list[protocol.GroupOutcome]] = {}  # Acks to send after this receive batch
        self._taken = [0, 0, 0]  # groups, samples, tokens accepted in this receive batch (counted at its end)

    def take(self, ident: bytes, daemon_id: str, msg: protocol.SampleGroup, arrays) -> bool:
        """Check, settle and buffer one returned group; its outcome goes into the batch's Ack. True if accepted."""
        rec = self.book.live.get(msg.lease_id)
        problem = check_group(msg, arrays, n_samples=self.cfg.rollout.n_samples,
                              max_new_tokens=self.cfg.rollout.max_new_tokens, vocab_size=self.vocab_size,
                              min_version=rec.min_version if rec else None, newest_version=self.gate.version)
        status, ref = self.book.settle(msg.lease_id, msg.prompt_id, msg.epoch)
        if status != "ok":
            problem = problem or status
        elif problem is None and arrays[0].tobytes() != self.prompt_tokens(msg.prompt_id).tobytes():
            problem = "prompt tokens differ from the lease"
        elif problem is None and not self.gate.usable(msg.weight_version, self.gate.version):
            problem = "stale"
            self.stale += 1
        outcomes = self._outcomes.setdefault(ident, [])
        if problem is not None:
            if ref is not None:  # it was a live prompt: regenerate it elsewhere
                give_back(self.cursor, self.gate, [ref])
            self.m.groups_dropped.labels(problem.split(":")[0]).inc()
            self.rate_log.warning(problem.split(":")[0], "refused group (lease %d, prompt %d) from %s: %s",
                                  msg.lease_id, msg.prompt_id, daemon_id, problem)
            outcomes.append(protocol.GroupOutcome(msg.lease_id, msg.prompt_id, False, problem))
            return False
        responses, logprobs = split_frames(msg.response_lengths, arrays[1], arrays[2])
        self.book.mark_accepted(ref)
        self.batcher.add(Group(prompt_id=msg.prompt_id, epoch=msg.epoch, lease_id=msg.lease_id,
                               weight_version=msg.weight_version, prompt=arrays[0], responses=responses,
                               logprobs=logprobs, rewards=np.asarray(msg.rewards, dtype=np.float64),
                               finish_reasons=msg.finish_reasons, daemon=daemon_id, gen_seconds=msg.gen_seconds,
                               version_runs=msg.runs_of))
        self._taken[0] += 1
        self._taken[1] += len(responses)
        self._taken[2] += sum(msg.response_lengths)
        outcomes.append(protocol.GroupOutcome(msg.lease_id, msg.prompt_id, True))
        return True

    def flush(self) -> dict[bytes, list[protocol.GroupOutcome]]:
        """End of a receive batch: count its accepted groups, hand over its outcomes per rollout."""
        groups, samples, tokens = self._taken
        if groups:
            self._taken = [0, 0, 0]
            self.m.groups.inc(groups)
            self.m.samples.inc(samples)
            self.m.tokens.inc(tokens)
            self.m.queue_depth.set(len(self.batcher))
        outcomes, self._outcomes = self._outcomes, {}
        return outcomes
