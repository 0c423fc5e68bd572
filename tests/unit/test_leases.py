"""PromptCursor and LeaseBook: every prompt walked once per epoch, every lease accounted for."""

from __future__ import annotations

import random

import pytest

from offpolicy.hub.leases import LeaseBook, PromptCursor, PromptRef


def refs(epoch, ids):
    return [PromptRef(epoch, i) for i in ids]


def ids_of(rs):
    return [r.prompt_id for r in rs]


# -- PromptCursor ----------------------------------------------------------------------------------
def test_cursor_without_shuffle_walks_ids_in_order_then_starts_the_next_epoch():
    cur = PromptCursor(5, shuffle=False)
    assert cur.take(3) == refs(0, [0, 1, 2])
    assert cur.take(4) == refs(0, [3, 4]) + refs(1, [0, 1])
    assert cur.epoch == 1
    assert cur.take(3) == refs(1, [2, 3, 4])
    assert cur.take(1) == refs(2, [0])
    assert cur.handed_out == 11


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 7, 10])
def test_cursor_hands_out_every_id_exactly_once_per_epoch(shuffle, chunk):
    n, epochs = 10, 4
    cur = PromptCursor(n, shuffle=shuffle, seed=3)
    got = []
    while len(got) < n * epochs:
        got.extend(cur.take(min(chunk, n * epochs - len(got))))
    for e in range(epochs):
        part = got[e * n:(e + 1) * n]
        assert all(r.epoch == e for r in part)
        assert sorted(ids_of(part)) == list(range(n))
    assert cur.handed_out == n * epochs


def test_cursor_take_zero_hands_out_nothing():
    cur = PromptCursor(4, shuffle=False)
    assert cur.take(0) == []
    assert cur.handed_out == 0
    assert cur.take(1) == refs(0, [0])


def test_shuffle_is_seeded_same_seed_same_order():
    a, b = PromptCursor(50, shuffle=True, seed=7), PromptCursor(50, shuffle=True, seed=7)
    assert a.take(150) == b.take(150)


def test_shuffle_actually_shuffles_and_depends_on_seed_and_epoch():
    n = 50
    cur = PromptCursor(n, shuffle=True, seed=7)
    e0, e1 = ids_of(cur.take(n)), ids_of(cur.take(n))
    assert e0 != list(range(n))
    assert e0 != e1  # a new order each epoch
    other = ids_of(PromptCursor(n, shuffle=True, seed=8).take(n))
    assert other != e0  # another seed, another order
    assert sorted(e0) == sorted(e1) == sorted(other) == list(range(n))


def test_requeued_prompts_come_first_in_fifo_order_and_are_not_counted_again():
    cur = PromptCursor(10, shuffle=False)
    first = cur.take(4)
    assert cur.handed_out == 4
    cur.give_back([first[2], first[0]])
    cur.give_back([first[3]])
    got = cur.take(5)
    # requeue first (in the order given back), then the walk goes on where it stopped
    assert got == [first[2], first[0], first[3]] + refs(0, [4, 5])
    assert cur.handed_out == 6  # only the two fresh ones were added
    assert len(cur.requeue) == 0


def test_requeue_larger_than_the_take_keeps_the_rest():
    cur = PromptCursor(10, shuffle=False)
    cur.give_back(cur.take(5))
    assert cur.take(2) == refs(0, [0, 1])
    assert list(cur.requeue) == refs(0, [2, 3, 4])
    assert cur.handed_out == 5


def test_requeued_prompts_keep_their_epoch():
    cur = PromptCursor(3, shuffle=False)
    old = cur.take(3)
    cur.take(1)  # epoch 1 started
    cur.give_back([old[1]])
    assert cur.take(2) == [PromptRef(0, 1), PromptRef(1, 1)]


# -- LeaseBook -------------------------------------------------------------------------------------
def test_issue_assigns_increasing_ids_and_records_the_lease():
    book = LeaseBook()
    a = book.issue("r0", refs(0, [5, 6]), min_version=3, deadline=10.0)
    b = book.issue("r1", refs(0, [7]), min_version=4, deadline=11.0)
    assert (a.lease_id, b.lease_id) == (1, 2)
    assert (a.daemon, a.min_version, a.deadline) == ("r0", 3, 10.0)
    assert list(a.pending) == [PromptRef(0, 5), PromptRef(0, 6)]
    assert set(book.live) == {1, 2}
    assert book.issued == 2
    assert book.in_flight() == 3


def test_settle_ok_then_the_lease_closes_when_empty():
    book = LeaseBook()
    rec = book.issue("r0", refs(2, [5, 6]), 0, 10.0)
    assert book.settle(rec.lease_id, 6, 2) == ("ok", PromptRef(2, 6))
    assert book.in_flight() == 1
    assert rec.lease_id in book.live
    assert book.settle(rec.lease_id, 5, 2) == ("ok", PromptRef(2, 5))
    assert book.in_flight() == 0
    assert rec.lease_id not in book.live


def test_settling_a_prompt_twice_is_refused():
    book = LeaseBook()
    rec = book.issue("r0", refs(0, [1, 2]), 0, 10.0)
    assert book.settle(rec.lease_id, 1, 0)[0] == "ok"
    assert book.settle(rec.lease_id, 1, 0) == ("not in lease", None)
    assert book.in_flight() == 1


def test_settling_the_last_prompt_twice_is_refused():
    book = LeaseBook()
    rec = book.issue("r0", refs(0, [1]), 0, 10.0)
    assert book.settle(rec.lease_id, 1, 0)[0] == "ok"
    status, ref = book.settle(rec.lease_id, 1, 0)
    assert status != "ok" and ref is None
    assert book.in_flight() == 0


def test_settle_refuses_a_prompt_not_in_the_lease_or_of_another_epoch():
    book = LeaseBook()
    rec = book.issue("r0", refs(1, [1, 2]), 0, 10.0)
    assert book.settle(rec.lease_id, 3, 1) == ("not in lease", None)
    assert book.settle(rec.lease_id, 1, 0) == ("not in lease", None)
    assert book.in_flight() == 2


@pytest.mark.parametrize("lease_id", [0, -1, 2, 99])
def test_settle_refuses_unknown_lease_ids(lease_id):
    book = LeaseBook()
    book.issue("r0", refs(0, [1]), 0, 10.0)  # id 1 exists; 2 was never issued
    assert book.settle(lease_id, 1, 0) == ("unknown lease", None)
    assert book.in_flight() == 1


def test_expire_returns_unreturned_prompts_and_refuses_late_results():
    book = LeaseBook()
    a = book.issue("r0", refs(0, [1, 2, 3]), 0, deadline=10.0)
    b = book.issue("r1", refs(0, [4]), 0, deadline=20.0)
    assert book.settle(a.lease_id, 2, 0)[0] == "ok"
    assert book.expire(9.5) == []  # nothing overdue yet
    assert book.expired == 0
    assert sorted(book.expire(10.5)) == refs(0, [1, 3])
    assert book.expired == 1
    assert set(book.live) == {b.lease_id}
    assert book.in_flight() == 1
    assert book.settle(a.lease_id, 1, 0) == ("expired lease", None)
    assert book.settle(a.lease_id, 3, 0) == ("expired lease", None)
    assert book.settle(b.lease_id, 4, 0) == ("ok", PromptRef(0, 4))


def test_expire_by_daemon_ends_all_its_leases_whatever_their_deadline():
    book = LeaseBook()
    a1 = book.issue("a", refs(0, [1]), 0, deadline=100.0)
    b1 = book.issue("b", refs(0, [2]), 0, deadline=100.0)
    a2 = book.issue("a", refs(0, [3, 4]), 0, deadline=200.0)
    assert sorted(book.expire(0.0, daemon="a")) == refs(0, [1, 3, 4])
    assert book.expired == 2
    assert set(book.live) == {b1.lease_id}
    assert book.settle(a1.lease_id, 1, 0) == ("expired lease", None)
    assert book.settle(a2.lease_id, 4, 0) == ("expired lease", None)
    assert book.in_flight() == 1


def test_expire_by_daemon_also_ends_other_overdue_leases():
    book = LeaseBook()
    book.issue("a", refs(0, [1]), 0, deadline=100.0)
    book.issue("b", refs(0, [2]), 0, deadline=5.0)
    book.issue("c", refs(0, [3]), 0, deadline=100.0)
    assert sorted(book.expire(6.0, daemon="a")) == refs(0, [1, 2])
    assert book.in_flight() == 1


def test_in_flight_counts_pending_prompts_of_live_leases():
    book = LeaseBook()
    assert book.in_flight() == 0
    a = book.issue("r0", refs(0, [1, 2, 3]), 0, 10.0)
    book.issue("r1", refs(0, [4, 5]), 0, 20.0)
    assert book.in_flight() == 5
    book.settle(a.lease_id, 1, 0)
    assert book.in_flight() == 4
    book.expire(15.0)
    assert book.in_flight() == 2


def test_a_lease_cannot_hold_the_same_prompt_twice():
    book = LeaseBook()
    with pytest.raises(ValueError, match="same prompt twice"):
        book.issue("r0", [PromptRef(0, 1), PromptRef(0, 1)], 0, 10.0)
    assert book.live == {} and book.issued == 0
    assert book.issue("r0", refs(0, [1]), 0, 10.0).lease_id == 1  # no id was burnt


def test_mark_accepted_makes_a_regenerated_copy_a_duplicate():
    book = LeaseBook()
    a = book.issue("r0", refs(0, [1]), 0, 10.0)
    book.expire(11.0)
    b = book.issue("r1", refs(0, [1]), 0, 20.0)
    _, ref = book.settle(b.lease_id, 1, 0)
    book.mark_accepted(ref)
    assert book.accepted == {PromptRef(0, 1)}
    assert book.settle(a.lease_id, 1, 0) == ("expired lease", None)
    c = book.issue("r2", refs(0, [1]), 0, 30.0)  # only possible if the invariants were broken
    assert book.settle(c.lease_id, 1, 0) == ("duplicate", None)


def test_a_lease_can_hold_one_prompt_id_from_two_epochs():
    cur, book = PromptCursor(4, shuffle=False), LeaseBook()
    first = book.issue("r0", cur.take(4), 0, deadline=1.0)  # the whole of epoch 0
    cur.give_back(book.expire(2.0))  # r0 went silent: epoch 0 comes back to the requeue
    taken = cur.take(8)  # requeued epoch 0, then fresh epoch 1: ids 0..3 twice
    assert first.lease_id == 1 and len(set(taken)) == 8
    rec = book.issue("r1", taken, 0, deadline=10.0)
    for r in taken:
        assert book.settle(rec.lease_id, r.prompt_id, r.epoch) == ("ok", r)


def test_a_prompt_dropped_after_acceptance_can_be_regenerated():
    # the hub's sequence: accept a group (mark_accepted, buffer it), the batcher drops it as stale,
    # the hub gives its ref back to the cursor, someone leases and regenerates it
    cur, book = PromptCursor(10, shuffle=False), LeaseBook()
    a = book.issue("r0", cur.take(1), 0, 10.0)
    _, ref = book.settle(a.lease_id, 0, 0)
    book.mark_accepted(ref)
    book.unaccept(ref)  # Hub.next_batch after Batcher.drop_stale ...
    cur.give_back([ref])  # ... and Hub._give_back
    b = book.issue("r1", cur.take(1), 2, 20.0)
    assert book.settle(b.lease_id, 0, 0) == ("ok", ref)


# -- the accounting invariant, under random operations --------------------------------------------
def check_invariant(cur: PromptCursor, book: LeaseBook, handed: list[PromptRef], trained: list[PromptRef]):
    where = {r: 0 for r in handed}
    for r in cur.requeue:
        where[r] += 1
    for rec in book.live.values():
        for r in rec.pending:
            where[r] += 1
    for r in book.accepted:
        where[r] += 1
    assert all(c == 1 for c in where.values()), {r: c for r, c in where.items() if c != 1}
    assert len(where) == len(handed) == cur.handed_out  # nothing appeared that was not handed out
    assert len(trained) == len(set(trained)) == len(book.accepted)
    assert cur.handed_out == len(cur.requeue) + book.in_flight() + len(book.accepted)


def run_random_ops(seed: int, num_prompts: int, max_take: int, ops: int):
    rng = random.Random(seed)
    cur, book = PromptCursor(num_prompts, shuffle=True, seed=seed), LeaseBook()
    handed: list[PromptRef] = []
    trained: list[PromptRef] = []
    now = 0.0
    daemons = ["a", "b", "c"]
    for _ in range(ops):
        op = rng.choice(["lease", "lease", "return", "return", "return", "refuse", "bogus", "tick", "silent"])
        if op == "lease":
            before = cur.handed_out
            got = cur.take(rng.randint(1, max_take))
            handed.extend(got[len(got) - (cur.handed_out - before):])  # the fresh ones come last
            book.issue(rng.choice(daemons), got, 0, now + rng.uniform(1, 10))
        elif op in ("return", "refuse") and book.live:
            rec = book.live[rng.choice(list(book.live))]
            pick = rng.choice(list(rec.pending))
            status, ref = book.settle(rec.lease_id, pick.prompt_id, pick.epoch)
            assert status == "ok"
            if op == "return":  # accepted and (eventually) trained
                assert ref not in book.accepted
                book.mark_accepted(ref)
                trained.append(ref)
            else:  # refused at arrival (bad or stale group): regenerate elsewhere
                cur.give_back([ref])
        elif op == "bogus" and handed:  # a late, duplicate or forged result: must change nothing
            r = rng.choice(handed)
            status, ref = book.settle(rng.randint(-1, book.issued + 2), r.prompt_id, r.epoch)
            if status == "ok":  # it happened to be live: treat it as a normal return
                book.mark_accepted(ref)
                trained.append(ref)
            else:
                assert ref is None
        elif op == "tick":
            now += rng.uniform(0, 4)
            cur.give_back(book.expire(now))
        elif op == "silent":
            cur.give_back(book.expire(now, daemon=rng.choice(daemons)))
        check_invariant(cur, book, handed, trained)
    # drain: everything still out comes back and is trained, exactly once per (epoch, prompt)
    cur.give_back(book.expire(float("inf")))
    while cur.requeue:
        ref = cur.requeue.popleft()
        rec = book.issue("z", [ref], 0, float("inf"))
        status, got = book.settle(rec.lease_id, ref.prompt_id, ref.epoch)
        assert status == "ok"
        book.mark_accepted(got)
        trained.append(got)
    check_invariant(cur, book, handed, trained)
    assert sorted(trained) == sorted(handed)
    return cur


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_every_prompt_in_exactly_one_place_within_an_epoch(seed):
    # multi-prompt leases; few enough operations that the walk stays in epoch 0
    cur = run_random_ops(seed, num_prompts=2000, max_take=5, ops=400)
    assert cur.epoch == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_every_prompt_in_exactly_one_place_across_epochs(seed):
    # one-prompt leases over a tiny data set: many epochs, the same ids over and over
    cur = run_random_ops(seed, num_prompts=4, max_take=1, ops=400)
    assert cur.epoch >= 3
