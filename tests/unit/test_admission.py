"""StalenessGate and Batcher: the one-step-off rules, by hand and in a simulated run of the hub."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from offpolicy.hub.admission import Batcher, StalenessGate, drop_stale, give_back
from offpolicy.hub.batch import Group
from offpolicy.hub.leases import LeaseBook, PromptCursor, PromptRef


def group(prompt_id: int, version: int, epoch: int = 0, lease_id: int = 1) -> Group:
    return Group(prompt_id=prompt_id, epoch=epoch, lease_id=lease_id, weight_version=version,
                 prompt=np.array([11, 1, 2, 12], dtype=np.int32),
                 responses=[np.array([2, 1, 13], dtype=np.int32), np.array([1, 13], dtype=np.int32)],
                 logprobs=[np.array([-0.5, -0.25, -0.125], dtype=np.float32),
                           np.array([-1.0, -0.5], dtype=np.float32)],
                 rewards=np.array([1.0, 0.25]), finish_reasons=["stop", "stop"])


# -- StalenessGate ---------------------------------------------------------------------------------
def test_capacity_is_the_bound_minus_what_was_admitted():
    gate = StalenessGate(batch_groups=4, max_staleness=1)
    assert gate.capacity() == 8  # (0 + 1 + 1) * 4
    gate.admit(5)
    assert (gate.admitted, gate.capacity()) == (5, 3)
    gate.version = 2
    assert gate.capacity() == 11  # (2 + 1 + 1) * 4 - 5
    gate.admit(11)
    assert gate.capacity() == 0


@pytest.mark.parametrize("b,s,v,admitted,expected", [
    (1, 0, 0, 0, 1), (3, 0, 5, 15, 3), (3, 2, 5, 10, 14), (16, 1, 10, 186, 6), (2, 1, 0, 7, 0),
])
def test_capacity_table(b, s, v, admitted, expected):
    # (v + s + 1) * b - admitted, never below zero
    assert StalenessGate(b, s, version=v, admitted=admitted).capacity() == expected


def test_admit_beyond_capacity_raises_and_changes_nothing():
    gate = StalenessGate(batch_groups=2, max_staleness=1)
    gate.admit(3)
    with pytest.raises(ValueError, match="capacity 1"):
        gate.admit(2)
    assert gate.admitted == 3
    gate.admit(1)
    assert gate.capacity() == 0
    with pytest.raises(ValueError):
        gate.admit(1)
    gate.admit(0)  # admitting nothing is always fine
    assert gate.admitted == 4


def test_give_back_reopens_capacity():
    gate = StalenessGate(batch_groups=2, max_staleness=0)
    gate.admit(2)
    assert gate.capacity() == 0
    gate.give_back(1)
    assert (gate.admitted, gate.capacity()) == (1, 1)
    gate.admit(1)
    assert gate.capacity() == 0


@pytest.mark.parametrize("s", [0, 1, 2, 5])
def test_usable_iff_step_minus_generation_version_is_at_most_s(s):
    gate = StalenessGate(batch_groups=1, max_staleness=s)
    for step in range(8):
        for g in range(step + 1):
            assert gate.usable(g, step) == (step - g <= s)


def test_usable_by_hand():
    one = StalenessGate(batch_groups=1, max_staleness=1)
    assert one.usable(3, 3) and one.usable(2, 3) and not one.usable(1, 3)
    zero = StalenessGate(batch_groups=1, max_staleness=0)
    assert zero.usable(4, 4) and not zero.usable(3, 4)


def test_staleness_zero_admits_exactly_one_batch_per_version():
    gate = StalenessGate(batch_groups=4, max_staleness=0)
    for v in range(5):
        gate.version = v
        assert gate.capacity() == 4
        gate.admit(4)
        assert gate.capacity() == 0
        with pytest.raises(ValueError):
            gate.admit(1)


# -- Batcher ---------------------------------------------------------------------------------------
def test_take_returns_none_below_a_full_batch():
    bat = Batcher(StalenessGate(batch_groups=3, max_staleness=1))
    assert bat.take(0) is None
    bat.add(group(0, 0))
    bat.add(group(1, 0))
    assert bat.take(0) is None
    assert [g.prompt_id for g in bat.buffer] == [0, 1]  # nothing consumed


def test_take_is_oldest_version_first_and_arrival_order_within_a_version():
    bat = Batcher(StalenessGate(batch_groups=3, max_staleness=2))
    for pid, v in [(10, 2), (11, 1), (12, 2), (13, 1), (14, 0), (15, 2)]:
        bat.add(group(pid, v))
    batch = bat.take(2)
    assert [(g.prompt_id, g.weight_version) for g in batch] == [(14, 0), (11, 1), (13, 1)]
    assert [g.prompt_id for g in bat.buffer] == [10, 12, 15]  # the rest keep their arrival order
    assert [g.prompt_id for g in bat.take(3)] == [10, 12, 15]
    assert bat.buffer == []


def test_take_within_one_version_keeps_arrival_order_and_leaves_the_later_ones():
    bat = Batcher(StalenessGate(batch_groups=2, max_staleness=1))
    for pid in [5, 3, 9, 1]:
        bat.add(group(pid, 4))
    assert [g.prompt_id for g in bat.take(4)] == [5, 3]
    assert [g.prompt_id for g in bat.buffer] == [9, 1]


def test_drop_stale_removes_exactly_the_too_stale_groups():
    bat = Batcher(StalenessGate(batch_groups=2, max_staleness=1))
    for pid, v in [(0, 1), (1, 2), (2, 3), (3, 0), (4, 2), (5, 1)]:
        bat.add(group(pid, v))
    stale = bat.drop_stale(3)  # step 3 may use versions 2 and 3
    assert [(g.prompt_id, g.weight_version) for g in stale] == [(0, 1), (3, 0), (5, 1)]
    assert [g.prompt_id for g in bat.buffer] == [1, 2, 4]
    assert bat.drop_stale(3) == []
    assert [g.prompt_id for g in bat.buffer] == [1, 2, 4]


def test_drop_stale_with_staleness_zero_keeps_only_the_current_version():
    bat = Batcher(StalenessGate(batch_groups=1, max_staleness=0))
    for pid, v in [(0, 4), (1, 5), (2, 3)]:
        bat.add(group(pid, v))
    assert [g.prompt_id for g in bat.drop_stale(5)] == [0, 2]
    assert [g.prompt_id for g in bat.buffer] == [1]


def test_drop_stale_unaccepts_the_dropped_prompts_and_gives_them_back():
    gate = StalenessGate(batch_groups=2, max_staleness=1)
    bat, book, cursor = Batcher(gate), LeaseBook(), PromptCursor(10, shuffle=False)
    refs = cursor.take(3)
    gate.admit(3)
    rec = book.issue("r0", refs, 0, 1e9)
    for ref, version in zip(refs, [0, 1, 2]):
        status, got = book.settle(rec.lease_id, ref.prompt_id, ref.epoch)
        assert status == "ok"
        book.mark_accepted(got)
        bat.add(group(ref.prompt_id, version, ref.epoch, rec.lease_id))
    stale = drop_stale(bat, book, cursor, step=2)  # step 2 may use versions 1 and 2
    assert [g.prompt_id for g in stale] == [refs[0].prompt_id]
    assert [g.prompt_id for g in bat.buffer] == [refs[1].prompt_id, refs[2].prompt_id]
    assert gate.admitted == 2 and list(cursor.requeue) == [refs[0]]
    assert refs[0] not in book.accepted and {refs[1], refs[2]} <= book.accepted
    assert cursor.take(1) == [PromptRef(0, refs[0].prompt_id)]  # regenerated first
    assert drop_stale(bat, book, cursor, step=2) == [] and gate.admitted == 2


# -- a simulated run of the hub --------------------------------------------------------------------
TRAIN_SECONDS = 1.0


class SimHub:
    """The hub's bookkeeping in Hub's order (serve / take_group / next_batch), on a simulated clock.

    Rollouts generate with the newest version at lease time; a lease's results arrive together after a
    random delay. The learner trains one step in TRAIN_SECONDS and then publishes the next version.
    """

    def __init__(self, *, s: int, b: int, rollouts: int, credits: int, delay, seed: int):
        self.rng = random.Random(seed)
        self.s, self.b, self.credits, self.delay = s, b, credits, delay
        self.gate = StalenessGate(b, s)
        self.batcher = Batcher(self.gate)
        self.cursor = PromptCursor(10_000, shuffle=True, seed=seed)
        self.book = LeaseBook()
        self.idle = list(range(rollouts))
        self.events: list = []
        self.now, self.seq = 0.0, 0
        self.step, self.training = 0, False
        self.trained: list[tuple[int, Group]] = []  # (step, group)
        self.dropped_on_arrival = self.dropped_in_buffer = 0
        self.refused: list[str] = []
        self.max_in_flight = 0

    def push(self, when, kind, data):
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, data))

    def serve(self):
        for r in list(self.idle):
            room = min(self.credits, self.gate.capacity())
            if room <= 0:
                continue
            self.idle.remove(r)
            refs = self.cursor.take(room)
            self.gate.admit(len(refs))
            rec = self.book.issue(f"r{r}", refs, self.gate.version, self.now + 1e9)
            self.push(self.now + self.delay(self.rng), "results", (r, rec.lease_id, refs, self.gate.version))
            self.check()

    def take_group(self, lease_id, ref, version):
        status, got = self.book.settle(lease_id, ref.prompt_id, ref.epoch)
        if status != "ok":
            self.refused.append(status)
            return
        if not self.gate.usable(version, self.gate.version):
            self.dropped_on_arrival += 1
            give_back(self.cursor, self.gate, [got])
            return
        self.book.mark_accepted(got)
        self.batcher.add(group(got.prompt_id, version, got.epoch, lease_id))

    def next_batch(self):
        if self.training:
            return
        stale = drop_stale(self.batcher, self.book, self.cursor, self.step)  # what Hub.next_batch runs
        if stale:
            self.dropped_in_buffer += len(stale)
            self.serve()
        batch = self.batcher.take(self.step)
        if batch is not None:
            assert len(batch) == self.b
            self.trained.extend((self.step, g) for g in batch)
            self.training = True
            self.push(self.now + TRAIN_SECONDS, "trained", None)

    def check(self):
        in_flight = self.gate.admitted - len(self.trained)
        self.max_in_flight = max(self.max_in_flight, in_flight)
        assert in_flight <= (self.s + 1) * self.b
        assert self.gate.admitted <= (self.gate.version + self.s + 1) * self.b
        # every prompt handed out is requeued, leased, buffered or trained
        assert self.cursor.handed_out == (len(self.cursor.requeue) + self.book.in_flight()
                                          + len(self.batcher) + len(self.trained))

    def run(self, steps: int):
        self.serve()
        while self.step < steps:
            assert self.events, "the simulated run stalled"
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == "results":
                r, lease_id, refs, version = data
                for ref in refs:
                    self.take_group(lease_id, ref, version)
                self.idle.append(r)
                self.serve()
            else:  # the learner finished a step and publishes the next version
                self.training = False
                self.step += 1
                self.gate.version = self.step
                if self.step == steps:
                    break
                self.serve()
            self.next_batch()
            self.check()
        return self


def prompt(rng):  # a rollout answers within one training step
    return rng.uniform(0.05, 0.95) * TRAIN_SECONDS


def sometimes_slow(rng):  # one lease in four takes several training steps
    return rng.uniform(0.05, 0.95) * TRAIN_SECONDS * (6 if rng.random() < 0.25 else 1)


SHAPES = [dict(b=1, rollouts=1, credits=1), dict(b=4, rollouts=3, credits=2), dict(b=4, rollouts=8, credits=4),
          dict(b=3, rollouts=5, credits=1)]


@pytest.mark.parametrize("s", [0, 1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda d: "b{b}-r{rollouts}-c{credits}".format(**d))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_prompt_rollouts_respect_the_staleness_bound(s, shape, seed):
    sim = SimHub(s=s, **shape, delay=prompt, seed=seed).run(steps=25)
    assert sim.step == 25 and len(sim.trained) == 25 * shape["b"]
    for step, g in sim.trained:
        assert 0 <= step - g.weight_version <= s
    assert sim.dropped_on_arrival == sim.dropped_in_buffer == 0
    assert sim.refused == []
    assert sim.max_in_flight <= (s + 1) * shape["b"]
    trained = [(g.epoch, g.prompt_id) for _, g in sim.trained]
    assert len(set(trained)) == len(trained)  # nothing trained twice
    if s == 0:  # synchronous: every step trains on the version it was given
        assert all(step == g.weight_version for step, g in sim.trained)


@pytest.mark.parametrize("s", [1, 2])
def test_simulated_run_is_really_off_policy_when_s_allows_it(s):
    # enough rollouts that generation runs ahead of the learner: the bound is reached, not just kept
    sim = SimHub(s=s, b=4, rollouts=8, credits=4, delay=prompt, seed=0).run(steps=25)
    assert max(step - g.weight_version for step, g in sim.trained) == s
    assert sim.max_in_flight == (s + 1) * 4


@pytest.mark.parametrize("s", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_slow_rollouts_drop_stale_groups_but_never_train_them(s, seed):
    sim = SimHub(s=s, b=4, rollouts=6, credits=2, delay=sometimes_slow, seed=seed).run(steps=30)
    for step, g in sim.trained:
        assert 0 <= step - g.weight_version <= s
    assert sim.max_in_flight <= (s + 1) * 4
    trained = [(g.epoch, g.prompt_id) for _, g in sim.trained]
    assert len(set(trained)) == len(trained)


def test_simulated_slow_rollouts_do_produce_stale_groups():
    # the drop path above is exercised, both at arrival and in the batcher's buffer
    sims = [SimHub(s=s, b=4, rollouts=6, credits=2, delay=sometimes_slow, seed=seed).run(steps=30)
            for s in (0, 1, 2) for seed in (0, 1, 2)]
    assert sum(x.dropped_on_arrival for x in sims) > 0
    assert sum(x.dropped_in_buffer for x in sims) > 0


def test_simulated_slow_rollouts_never_refuse_a_regenerated_prompt():
    sim = SimHub(s=1, b=4, rollouts=6, credits=2, delay=sometimes_slow, seed=0).run(steps=30)
    assert sim.dropped_in_buffer > 0
    assert sim.refused == []
