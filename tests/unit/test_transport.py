"""transport.receive: batches of everything ready, senders, zero-copy arrays, rejects counted and skipped;
and the hub behind it: several groups that arrive together are answered with one Ack."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from offpolicy.plumbing.logs import RateLimitedLog
from offpolicy.wire import protocol, transport

log = RateLimitedLog(logging.getLogger("test.transport"))


def counter() -> Counter:
    return Counter("rejected", "test", ["reason"], registry=CollectorRegistry())


def count(c: Counter, reason: str) -> float:
    return c.labels(reason)._value.get()


def group(prompt_id: int, n: int = 2) -> tuple[protocol.SampleGroup, tuple[np.ndarray, ...]]:
    msg = protocol.SampleGroup(lease_id=1, prompt_id=prompt_id, epoch=0, weight_version=0, response_lengths=[3] * n,
                               rewards=[0.5] * n, finish_reasons=["stop"] * n)
    return msg, (np.array([1, 2], np.int32), np.arange(3 * n, dtype=np.int32), np.full(3 * n, -0.5, np.float32))


async def wait_ready(sock: zmq.asyncio.Socket, n: int) -> None:
    """Until `n` messages can be read at once (the sends went through ZeroMQ's I/O thread)."""
    for _ in range(200):
        if sock.get(zmq.EVENTS) & zmq.POLLIN:
            await asyncio.sleep(0.05)  # the rest of a burst sent together
            return
        await asyncio.sleep(0.01)
    raise AssertionError("nothing arrived")


@pytest.fixture
def pair(tmp_path):
    """An asyncio ROUTER bound on ipc, and a blocking DEALER connected to it."""
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    router = actx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/router.sock"
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"rollout-a")
    dealer.connect(address)
    yield router, dealer
    dealer.close(0)
    router.close(0)
    ctx.term()
    actx.term()


def test_receive_yields_everything_ready_as_one_batch_with_senders_and_zero_copy_arrays(pair):
    router, dealer = pair

    async def main():
        for i in range(5):
            msg, arrays = group(i)
            dealer.send_multipart(protocol.encode(msg, *arrays))
        await wait_ready(router, 5)
        it = transport.receive(router, rejected=counter(), log=log)
        batch = await anext(it)
        await it.aclose()
        return batch

    batch = asyncio.run(main())
    assert [r.msg.prompt_id for r in batch] == [0, 1, 2, 3, 4]
    assert all(r.sender == b"rollout-a" for r in batch)
    prompt, tokens, logprobs = batch[2].arrays
    assert prompt.tolist() == [1, 2] and tokens.tolist() == list(range(6)) and logprobs.tolist() == [-0.5] * 6
    for a in batch[2].arrays:  # views on the received frames, writable, not copies
        assert not a.flags.owndata and a.flags.writeable
        assert isinstance(a.base, zmq.Frame) or isinstance(getattr(a.base, "obj", None), zmq.Frame)


def test_receive_splits_a_burst_into_batches_of_at_most_max_batch(pair):
    router, dealer = pair

    async def main():
        for _ in range(7):
            dealer.send_multipart(protocol.encode(protocol.Heartbeat(daemon_id="a", weight_version=0, busy_groups=0)))
        await wait_ready(router, 7)
        it = transport.receive(router, rejected=counter(), log=log, max_batch=3)
        sizes = []
        while sum(sizes) < 7:
            sizes.append(len(await anext(it)))
        await it.aclose()
        return sizes

    assert asyncio.run(main()) == [3, 3, 1]


def test_receive_counts_reports_and_skips_what_does_not_decode(pair):
    router, dealer = pair
    rejected = counter()
    refused: list[tuple[bytes | None, str]] = []

    async def on_reject(sender, reason, error):
        assert isinstance(error, protocol.ProtocolError)
        refused.append((sender, reason))

    async def main():
        dealer.send_multipart([b"\xff\x00garbage"])
        dealer.send_multipart([msgspec.msgpack.encode({"type": "work", "proto": 99, "credits": 1})])
        msg, arrays = group(7)
        dealer.send_multipart(protocol.encode(msg, *arrays)[:-1])  # a frame short
        dealer.send_multipart(protocol.encode(protocol.WorkRequest(credits=3)))
        await wait_ready(router, 4)
        it = transport.receive(router, rejected=rejected, log=log, on_reject=on_reject)
        batch = await anext(it)
        await it.aclose()
        return batch

    batch = asyncio.run(main())
    assert [r.msg for r in batch] == [protocol.WorkRequest(credits=3)]
    assert refused == [(b"rollout-a", "bad_message"), (b"rollout-a", "protocol_version"), (b"rollout-a", "bad_message")]
    assert count(rejected, "bad_message") == 2 and count(rejected, "protocol_version") == 1


def test_receive_on_a_dealer_has_no_sender(tmp_path):
    async def main():
        actx = zmq.asyncio.Context()
        router, dealer = actx.socket(zmq.ROUTER), actx.socket(zmq.DEALER)
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
        router.bind(f"ipc://{tmp_path}/r.sock")
        dealer.connect(f"ipc://{tmp_path}/r.sock")
        await dealer.send_multipart(protocol.encode(protocol.VersionQuery()))
        ident, _ = await router.recv_multipart()
        await router.send_multipart([ident, *protocol.encode(protocol.Goodbye(reason="over"))])
        it = transport.receive(dealer, rejected=counter(), log=log)
        batch = await anext(it)
        await it.aclose()
        dealer.close(0)
        router.close(0)
        actx.term()
        return batch

    (r,) = asyncio.run(main())
    assert r.msg == protocol.Goodbye(reason="over") and r.sender is None and r.arrays == []


def test_reject_reason_names_the_protocol_version_apart():
    assert transport.reject_reason(protocol.ProtocolVersionError("protocol version 9")) == "protocol_version"
    assert transport.reject_reason(protocol.ProtocolError("undecodable header: version")) == "bad_message"


# -- the hub over a real socket ------------------------------------------------------------------------
def hub_config(n: int):
    from offpolicy.config import load_config

    return load_config(None, [f"rollout.n_samples={n}", "rollout.max_new_tokens=4", "learner.batch_groups=2",
                              "algo.max_staleness=2", "data.shuffle=false", "data.synthetic.num_prompts=6",
                              "model.arch.model_type=llama"])


@contextlib.asynccontextmanager
async def hub_and_dealer(cfg, tmp_path, vocab: int):
    """A started Hub with version 0 announced, and a DEALER connected to it; yields (hub, send, recv)."""
    from offpolicy.data.datasets import load_dataset
    from offpolicy.data.tokenizer import load_tokenizer
    from offpolicy.hub.hub import Hub
    from offpolicy.plumbing.metrics import LearnerMetrics

    hub = Hub(cfg, load_dataset(cfg.data), load_tokenizer(cfg.model.tokenizer), LearnerMetrics(), vocab_size=vocab)
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    work = f"ipc://{tmp_path}/work.sock"
    await hub.start(actx, work=work, announce=f"ipc://{tmp_path}/announce.sock")
    await hub.announce(protocol.WeightAnnouncement(version=0, path="", total_bytes=0, publish_seconds=0.0, step=0))
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(work)

    async def recv(timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while not s.poll(0):
            assert time.monotonic() < deadline, f"nothing from the hub in {timeout} s"
            await asyncio.sleep(0.01)
        return protocol.decode(s.recv_multipart())

    try:
        yield hub, s, recv
    finally:
        s.close(0)
        await hub.close("test over")
        ctx.term()
        actx.term()


def test_hub_answers_groups_that_arrive_together_with_one_ack(tmp_path):
    n, vocab = 2, 1000
    cfg = hub_config(n)

    async def main():
        async with hub_and_dealer(cfg, tmp_path, vocab) as (hub, s, recv):
            s.send_multipart(protocol.encode(protocol.Hello(daemon_id="r0", engine="none", max_groups=6)))
            assert isinstance((await recv())[0], protocol.Welcome)
            s.send_multipart(protocol.encode(protocol.WorkRequest(credits=6)))
            lease, (tokens,) = await recv()
            assert isinstance(lease, protocol.Lease) and len(lease.prompts) == 6
            prompts = np.split(tokens, np.cumsum([p.n_tokens for p in lease.prompts])[:-1])
            # all six sent before the hub's loop runs again: they arrive as one batch
            for i, p in enumerate(lease.prompts):
                bad = i == 4  # a token id outside the vocabulary: refused, given back, in the same Ack
                msg = protocol.SampleGroup(lease_id=lease.lease_id, prompt_id=p.prompt_id, epoch=p.epoch,
                                           weight_version=0, response_lengths=[2] * n, rewards=[1.0] * n,
                                           finish_reasons=["stop"] * n)
                resp = np.full(2 * n, vocab if bad else 5, np.int32)
                s.send_multipart(protocol.encode(msg, prompts[i], resp, np.full(2 * n, -0.5, np.float32)))
            time.sleep(0.5)  # blocking: the hub's loop cannot run until all six are at its socket
            ack, _ = await recv()
            await asyncio.sleep(0.1)
            assert not s.poll(0)  # nothing else: one Ack answered all six
            batches = [await hub.next_batch(0), await hub.next_batch(0)]
            batches.append(list(hub.batcher.buffer))  # the fifth accepted group waits for the next step
            return lease, ack, batches, hub.m

    lease, ack, batches, m = asyncio.run(main())
    assert isinstance(ack, protocol.Ack)
    expected = [(p.prompt_id, i != 4) for i, p in enumerate(lease.prompts)]
    assert [(g.prompt_id, g.accepted) for g in ack.groups] == expected
    assert ack.groups[4].reason.startswith("token id")
    assert {g.lease_id for g in ack.groups} == {lease.lease_id}
    taken = sorted(g.prompt_id for b in batches for g in b)
    assert taken == sorted(p.prompt_id for i, p in enumerate(lease.prompts) if i != 4)
    assert all(len(r) == 2 and r.flags.writeable for b in batches for g in b for r in g.responses)
    assert m.groups._value.get() == 5 and m.tokens._value.get() == 5 * 2 * n


def test_a_connection_that_says_hello_as_another_daemon_gives_back_the_old_ones_prompts_at_once(tmp_path):
    cfg = hub_config(2)

    async def main():
        async with hub_and_dealer(cfg, tmp_path, 1000) as (hub, s, recv):
            leases = []
            for name in ("r0", "r0", "r1"):  # the same name again keeps the lease; another name gives it back
                s.send_multipart(protocol.encode(protocol.Hello(daemon_id=name, engine="none", max_groups=6)))
                assert isinstance((await recv())[0], protocol.Welcome)
                s.send_multipart(protocol.encode(protocol.WorkRequest(credits=3)))
                leases.append((await recv())[0])
            return leases, hub.book, hub.m

    (a, b, c), book, m = asyncio.run(main())
    first = {p.prompt_id for p in a.prompts}
    assert first.isdisjoint(p.prompt_id for p in b.prompts)  # r0 still held its first three prompts
    assert first == {p.prompt_id for p in c.prompts}  # r1 was given r0's first prompts back, not after a timeout
    assert m.leases_expired._value.get() == 2 and book.expired == 2  # both of r0's leases ended


def test_a_restarted_rollout_takes_its_predecessors_place_and_prompts_at_once(tmp_path):
    """A Hello under the slot of a live daemon (its predecessor was killed: no Goodbye, no timeout yet) gives the
    predecessor's leased prompts back at once; a daemon of another slot keeps its own."""
    cfg = hub_config(2)

    async def main():
        async with hub_and_dealer(cfg, tmp_path, 1000) as (hub, s, recv):
            ctx = zmq.Context()
            later = []

            async def join(sock, daemon_id, slot):
                sock.send_multipart(protocol.encode(protocol.Hello(daemon_id=daemon_id, slot=slot, engine="none",
                                                                   max_groups=6)))
                deadline = time.monotonic() + 10
                while not sock.poll(0):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                assert isinstance(protocol.decode(sock.recv_multipart())[0], protocol.Welcome)
                sock.send_multipart(protocol.encode(protocol.WorkRequest(credits=3)))
                while not sock.poll(0):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                return protocol.decode(sock.recv_multipart())[0]

            try:
                first = await join(s, "rollout-0@h:1", "rollout-0@h")  # killed after this: never heard of again
                for _ in range(2):
                    later.append(ctx.socket(zmq.DEALER))
                    later[-1].setsockopt(zmq.LINGER, 0)
                    later[-1].connect(f"ipc://{tmp_path}/work.sock")
                other = await join(later[0], "rollout-1@h:7", "rollout-1@h")
                again = await join(later[1], "rollout-0@h:2", "rollout-0@h")  # its restart
                return first, other, again, sorted(p.daemon_id for p in hub.peers.values()), hub.book, hub.accounting()
            finally:
                for sock in later:
                    sock.close(0)
                ctx.term()

    first, other, again, peers, book, acct = asyncio.run(main())
    mine = {p.prompt_id for p in first.prompts}
    assert mine.isdisjoint(p.prompt_id for p in other.prompts)
    assert {p.prompt_id for p in again.prompts} == mine  # handed back at once, first in line
    assert peers == ["rollout-0@h:2", "rollout-1@h:7"]  # the predecessor is forgotten, the other slot kept
    assert {r.daemon for r in book.live.values()} == {"rollout-0@h:2", "rollout-1@h:7"}
    assert acct["prompts_requeued"] == 3 and acct["prompts_waiting_requeue"] == 0  # given back, leased again


def test_a_waiting_learner_is_woken_once_its_batch_is_complete_not_per_group(tmp_path):
    n, cfg = 2, hub_config(2)  # batch_groups = 2

    async def main():
        async with hub_and_dealer(cfg, tmp_path, 1000) as (hub, s, recv):
            s.send_multipart(protocol.encode(protocol.Hello(daemon_id="r0", engine="none", max_groups=2)))
            assert isinstance((await recv())[0], protocol.Welcome)
            s.send_multipart(protocol.encode(protocol.WorkRequest(credits=2)))
            lease, (tokens,) = await recv()
            prompts = np.split(tokens, np.cumsum([p.n_tokens for p in lease.prompts])[:-1])
            tries, take = [], hub.batcher.take
            hub.batcher.take = lambda step: tries.append(step) or take(step)  # one call per wake-up of the learner
            learner = asyncio.create_task(hub.next_batch(0))
            await asyncio.sleep(0.05)
            woken = []
            for i, p in enumerate(lease.prompts):
                msg = protocol.SampleGroup(lease_id=lease.lease_id, prompt_id=p.prompt_id, epoch=p.epoch,
                                           weight_version=0, response_lengths=[2] * n, rewards=[1.0] * n,
                                           finish_reasons=["stop"] * n)
                s.send_multipart(protocol.encode(msg, prompts[i], np.full(2 * n, 5, np.int32),
                                                 np.full(2 * n, -0.5, np.float32)))
                await recv()  # its Ack: the hub has taken the group
                await asyncio.sleep(0.05)  # a woken learner has looked by now
                woken.append(len(tries))
            t0 = time.monotonic()
            batch = await asyncio.wait_for(learner, 5)
            return woken, batch, time.monotonic() - t0

    woken, batch, waited = asyncio.run(main())
    assert woken == [1, 2]  # one look at the start; one group of two: asleep on; the second completes the batch
    assert len(batch) == 2 and waited < 0.5  # woken by the group, not by the once-a-second check
