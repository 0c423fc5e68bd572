"""Tests for offpolicy/weights/subscribe.py: the `subscribe` API following a store by scanning it (late joiners,
latest-only and every version, timeouts, stop, holding and releasing versions, verification) and by a real ZeroMQ
PUB socket's announcements."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import torch
import zmq

from offpolicy.wire import protocol
from offpolicy.weights import WeightStore, list_versions, subscribe, version_dir
from tests.weight_stores import RUN, publish, small_tensors


# ---------------------------------------------------------------- subscribe (store scan)


def _collect(gen, out: list, got: queue.Queue | None = None):
    for wv in gen:
        out.append(wv.version)
        if got is not None:
            got.put(wv.version)


def test_subscribe_late_joiner_gets_newest_then_each_new_version_in_order(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    for v in range(3):
        publish(store, v)
    seen: list[int] = []
    got: queue.Queue = queue.Queue()
    t = threading.Thread(target=_collect, args=(subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=2.0), seen, got))
    t.start()
    try:
        assert got.get(timeout=10) == 2  # the newest existing one first, not 0
        for v in range(3, 6):
            publish(store, v)
            assert got.get(timeout=10) == v
    finally:
        t.join(timeout=30)
    assert not t.is_alive()
    assert seen == [2, 3, 4, 5]


def test_subscribe_latest_only_jumps_to_the_newest(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=1.0)
    first = next(gen)
    assert first.version == 0
    for v in (1, 2, 3):  # published while the subscriber is busy
        publish(store, v)
    assert next(gen).version == 3
    assert list(gen) == []  # then nothing new: ends after timeout_s


def test_subscribe_all_versions_in_order(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    for v in range(4):
        publish(store, v)
    got = [wv.version for wv in subscribe(str(tmp_path), RUN, latest_only=False, poll_s=0.02, timeout_s=0.5)]
    assert got == [0, 1, 2, 3]
    got = [wv.version for wv in subscribe(str(tmp_path), RUN, latest_only=False, start=2, poll_s=0.02,
                                          timeout_s=0.5)]
    assert got == [2, 3]

    gen = subscribe(str(tmp_path), RUN, latest_only=False, start=4, poll_s=0.02, timeout_s=1.0)
    seen: list[int] = []
    t = threading.Thread(target=_collect, args=(gen, seen))
    t.start()
    time.sleep(0.1)
    for v in (4, 5, 6):
        publish(store, v)
    t.join(timeout=30)
    assert not t.is_alive()
    assert seen == [4, 5, 6]


def test_subscribe_all_versions_yields_every_version_published_in_a_burst(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, latest_only=False, poll_s=0.02, timeout_s=1.0)
    assert next(gen).version == 0
    for v in (1, 2, 3):
        publish(store, v)
    assert [wv.version for wv in gen] == [1, 2, 3]


def test_subscribe_ends_after_timeout(tmp_path):
    WeightStore(str(tmp_path), RUN)
    t0 = time.monotonic()
    assert list(subscribe(str(tmp_path), RUN, poll_s=0.05, timeout_s=0.3)) == []
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 3


def test_subscribe_ends_when_stop_is_set(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    publish(store, 0)
    stop = threading.Event()
    gen = subscribe(str(tmp_path), RUN, poll_s=0.05, stop=stop)  # no timeout
    assert next(gen).version == 0
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert list(gen) == []
    assert time.monotonic() - t0 < 5


def test_subscribe_releases_the_previous_version_unless_hold(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=2.0)
    v0 = next(gen)
    v0_tensors = v0.tensors  # mapped while held
    publish(store, 1)
    assert list_versions(tmp_path, RUN) == [0, 1]  # held by the subscriber
    assert next(gen).version == 1  # yielding v1 releases v0
    publish(store, 2)
    assert list_versions(tmp_path, RUN) == [1, 2]
    assert torch.equal(v0_tensors["lm_head.weight"], small_tensors(0)["lm_head.weight"])  # views still valid
    gen.close()  # leaving the loop releases the current one
    assert store.collect() == [1]

    held = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=2.0, hold=True)
    a = next(held)
    assert a.version == 2
    publish(store, 3)
    b = next(held)
    assert b.version == 3
    publish(store, 4)
    assert list_versions(tmp_path, RUN) == [2, 3, 4]  # the caller holds both
    held.close()
    a.close()
    b.close()
    assert store.collect() == [2, 3]


def test_subscribe_verify_yields_verified_versions(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    publish(store, 0)
    gen = subscribe(str(tmp_path), RUN, poll_s=0.02, timeout_s=0.3, verify=True)
    wv = next(gen)
    assert wv.version == 0 and torch.equal(wv.tensors["model.norm.weight"], small_tensors(0)["model.norm.weight"])
    gen.close()


# ---------------------------------------------------------------- subscribe with a real PUB socket


def _announce(pub: zmq.Socket, store_root: Path, version: int) -> None:
    msg = protocol.WeightAnnouncement(version=version, path=str(version_dir(store_root, RUN, version)),
                                      total_bytes=0, publish_seconds=0.0, step=version)
    pub.send_multipart(protocol.encode(msg))


def test_subscribe_follows_announcements_and_ends_on_goodbye(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=10)
    publish(store, 0)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    # poll_s is long: only an announcement can wake the subscriber quickly
    gen = subscribe(str(tmp_path), RUN, announce=f"tcp://127.0.0.1:{port}", poll_s=5.0, timeout_s=60.0)
    seen: list[int] = []
    got: queue.Queue = queue.Queue()
    t = threading.Thread(target=_collect, args=(gen, seen, got), daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        first = None
        while first is None and time.monotonic() - t0 < 20:  # the SUB side connects asynchronously
            pub.send_multipart([b"not a protocol message"])  # ignored, never fatal
            _announce(pub, tmp_path, 0)
            try:
                first = got.get(timeout=0.05)
            except queue.Empty:
                pass
        assert first == 0

        publish(store, 1)
        t1 = time.monotonic()
        _announce(pub, tmp_path, 1)
        assert got.get(timeout=10) == 1
        assert time.monotonic() - t1 < 3  # woken by the announcement, not by the 5 s store scan

        t2 = time.monotonic()
        while t.is_alive() and time.monotonic() - t2 < 20:
            pub.send_multipart(protocol.encode(protocol.Goodbye(reason="done")))
            t.join(timeout=0.05)
        assert not t.is_alive()
        assert time.monotonic() - t2 < 3  # ended by Goodbye, long before timeout_s
    finally:
        pub.close(0)
        ctx.term()
    assert seen == [0, 1]


def test_subscribe_with_verify_skips_a_corrupt_version_and_keeps_going(tmp_path):
    store = WeightStore(str(tmp_path), "run", keep=10)
    for v in range(3):
        publish(store, v)
    shard = next((tmp_path / "run" / "v2").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    publish(store, 3)
    seen = [wv.version for wv in subscribe(str(tmp_path), "run", latest_only=False, verify=True, poll_s=0.05,
                                           timeout_s=0.5)]
    assert seen == [0, 1, 3]
