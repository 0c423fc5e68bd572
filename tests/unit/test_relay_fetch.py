"""Tests for offpolicy.relay.fetch in one process over real ZeroMQ sockets and real stores in /dev/shm:
a version arrives byte for byte and in order; one that fails its checksum is refused while the
previous one stays; a hostile upstream (unsafe manifest, garbage frames, silence) is counted and
skipped, and the fetcher re-attaches to the next upstream and finishes the version there."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from offpolicy.config import RelayConfig, TransportConfig
from offpolicy.relay.catalog import Catalog
from offpolicy.relay.fetch import Fetcher, Upstream
from offpolicy.relay.metrics import RelayMetrics
from offpolicy.relay.server import ShardServer
from offpolicy.weights import WeightStore, list_versions, version_dir
from offpolicy.weights.store import MANIFEST, Manifest
from offpolicy.wire import protocol, transport

RUN = "fetch"
CFG = RelayConfig(chunk_bytes=64 * 1024, window=4, peer_timeout_s=0.6)


def publish(store: WeightStore, version: int) -> Path:
    g = torch.Generator().manual_seed(version)
    tensors = {f"t{i}": torch.randn(30_000, generator=g) for i in range(4)}
    store.publish(version, iter(tensors.items()), {"model_type": "llama"})
    return version_dir(store.root, RUN, version)


def publish_damaged(store: WeightStore, version: int) -> None:
    """Publish, then flip one byte in the middle of a shard: the size still matches, the sha256 does not."""
    shard = next(p for p in publish(store, version).iterdir() if p.suffix == ".safetensors")
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def value(metrics: RelayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


class Source:
    """The learner-side shard server; `paused()` holds requests in its socket while a test changes the store."""

    def __init__(self, ctx, root: str):
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        self.server = ShardServer(router, Catalog(root, RUN, idle_s=5), RelayMetrics())
        self.task = asyncio.ensure_future(self.server.serve_forever())

    async def change(self, fn, *args):
        """Run `fn(*args)` in a thread with the server stopped, then serve (and wake parked queries) again."""
        self.task.cancel()
        out = await asyncio.to_thread(fn, *args)
        self.task = asyncio.ensure_future(self.server.serve_forever())
        await self.server.wake()
        return out

    async def end(self) -> None:
        self.server.catalog.ended = True
        await self.server.wake()

    def close(self) -> None:
        self.task.cancel()


def relay(ctx, root: str, upstreams: list[str], cfg: RelayConfig = CFG):
    """A relay's fetcher (and its own server, for downstream) into the store at `root`."""
    metrics, store = RelayMetrics(), WeightStore(root, RUN, keep=3)
    catalog = Catalog(root, RUN, idle_s=5)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind_to_random_port("tcp://127.0.0.1")
    arrived: list[tuple[int, float]] = []

    async def on_version(version: int, manifest: Manifest, seconds: float) -> None:
        arrived.append((version, manifest.total_bytes))

    up = Upstream(ctx, upstreams, TransportConfig(), metrics, cfg.peer_timeout_s)
    fetcher = Fetcher(up, store, catalog, ShardServer(router, catalog, metrics), metrics, cfg, on_version)
    return fetcher, metrics, arrived


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


async def following(ctx, shm_root: str, learner: WeightStore, cfg: RelayConfig = CFG):
    """A source on `learner` and a relay following it, once the relay has the first version."""
    source = Source(ctx, learner.root)
    fetcher, metrics, arrived = relay(ctx, f"{shm_root}/relay", [source.address], cfg)
    follow = asyncio.ensure_future(fetcher.run())
    await until(lambda: arrived)
    return source, fetcher, metrics, arrived, follow


def run(test) -> None:
    async def main():
        ctx = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(test(ctx), 30)
        finally:
            ctx.destroy(0)

    asyncio.run(main())


def test_versions_arrive_byte_for_byte_and_in_order(shm_root):
    learner = WeightStore(f"{shm_root}/learner", RUN, keep=5)
    paths = [publish(learner, v) for v in range(3)]

    async def test(ctx):
        source = Source(ctx, learner.root)
        await source.end()  # everything is published: the fetcher returns when it has it all
        fetcher, metrics, arrived = relay(ctx, f"{shm_root}/relay", [source.address])
        await fetcher.run()
        source.close()
        # a late joiner starts with the newest version, then follows in order (nothing newer here)
        assert [v for v, _ in arrived] == [2]
        assert list_versions(f"{shm_root}/relay", RUN) == [2]
        for name in os.listdir(paths[2]):
            assert (version_dir(f"{shm_root}/relay", RUN, 2) / name).read_bytes() == (paths[2] / name).read_bytes()
        sizes = sum(e.bytes for e in msgspec.json.decode((paths[2] / MANIFEST).read_bytes(), type=Manifest).files.values())
        assert value(metrics, "offpolicy_relay_bytes_total", direction="in") == sizes
        assert value(metrics, "offpolicy_relay_versions_total", outcome="complete") == 1

    run(test)


def test_following_a_live_learner_fetches_every_version_in_order(shm_root):
    learner = WeightStore(f"{shm_root}/learner", RUN, keep=5)
    publish(learner, 0)

    async def test(ctx):
        source, fetcher, metrics, arrived, follow = await following(ctx, shm_root, learner)
        for v in (1, 2, 3):
            await until(lambda: len(arrived) >= v)
            await asyncio.to_thread(publish, learner, v)
            await source.server.wake()
        await source.end()
        await follow
        source.close()
        assert [v for v, _ in arrived] == [0, 1, 2, 3]
        assert list_versions(f"{shm_root}/relay", RUN) == [0, 1, 2, 3]  # collecting is the daemon's job

    run(test)


def test_a_version_failing_its_checksum_is_refused_and_the_old_one_stays(shm_root):
    learner = WeightStore(f"{shm_root}/learner", RUN, keep=5)
    publish(learner, 0)

    async def test(ctx):
        source, fetcher, metrics, arrived, follow = await following(ctx, shm_root, learner)
        await source.change(publish_damaged, learner, 1)
        await until(lambda: value(metrics, "offpolicy_relay_checksum_failures_total") >= 1)
        await source.change(publish, learner, 2)
        await source.end()
        await follow
        source.close()
        assert [v for v, _ in arrived] == [0, 2]
        assert list_versions(f"{shm_root}/relay", RUN) == [0, 2]
        assert not [e for e in os.scandir(f"{shm_root}/relay/{RUN}") if e.name.startswith(".")]
        assert value(metrics, "offpolicy_relay_versions_total", outcome="refused") == 1

    run(test)


class Corrupting(ShardServer):
    """A source that damages one byte of every chunk it serves of `version`, after computing its CRC-32 (bytes
    going bad between the source's read and the relay's write)."""

    version = -1

    async def _send_chunk(self, peer, req, entry):
        if req.version != self.version or req.length == 0:
            return await super()._send_chunk(peer, req, entry)
        data = entry.view(req.file, req.offset, req.length).copy()
        data[len(data) // 2] ^= 0x10
        reply = protocol.Chunk(version=req.version, file=req.file, offset=req.offset, length=req.length,
                               crc32=entry.crc32(req.file, req.offset, req.length))
        await transport.send(self.sock, reply, data, to=peer)


def test_without_sha256_a_chunk_damaged_after_the_sources_read_is_refused_and_the_old_one_stays(shm_root):
    learner = WeightStore(f"{shm_root}/learner", RUN, keep=5, checksum="none")
    paths = [publish(learner, 0)]

    async def test(ctx):
        source, fetcher, metrics, arrived, follow = await following(ctx, shm_root, learner)
        source.server.__class__, source.server.version = Corrupting, 1
        paths.append(await source.change(publish, learner, 1))
        await until(lambda: value(metrics, "offpolicy_relay_checksum_failures_total") >= 1)
        paths.append(await source.change(publish, learner, 2))
        await source.end()
        await follow
        source.close()
        assert [v for v, _ in arrived] == [0, 2]  # 0 and 2 checked chunk by chunk against the source's CRCs
        assert list_versions(f"{shm_root}/relay", RUN) == [0, 2]
        for v in (0, 2):
            for name in os.listdir(paths[v]):
                assert (version_dir(f"{shm_root}/relay", RUN, v) / name).read_bytes() == (paths[v] / name).read_bytes()
        assert not [e for e in os.scandir(f"{shm_root}/relay/{RUN}") if e.name.startswith(".")]
        assert value(metrics, "offpolicy_relay_versions_total", outcome="refused") == 1

    run(test)


async def hostile(ctx, behaviour: str) -> tuple[str, asyncio.Task, list]:
    """A fake upstream: 'unsafe' offers a manifest naming ../escape; 'garbage' offers the real manifest of
    version 0 from `behaviour`'s store and then answers chunk requests with undecodable frames."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list = []

    async def loop():
        while True:
            peer, *frames = await router.recv_multipart()
            msg, _ = protocol.decode(frames)
            seen.append(type(msg).__name__)
            if isinstance(msg, protocol.RelayQuery):
                raw = HOSTILE_MANIFEST if behaviour == "unsafe" else Path(behaviour, MANIFEST).read_bytes()
                await router.send_multipart([peer, *protocol.encode(protocol.RelayOffer(
                    version=0, newest=0, manifest=raw))])
            else:
                await router.send_multipart([peer, b"\xc1 garbage"])

    return f"tcp://127.0.0.1:{port}", asyncio.ensure_future(loop()), seen


HOSTILE_MANIFEST = b'{"version":0,"created_unix":0,"total_bytes":1,"num_tensors":1,"files":{"../escape":{"bytes":1}}}'


def test_an_unsafe_manifest_is_refused_and_nothing_is_written(shm_root):
    async def test(ctx):
        address, task, seen = await hostile(ctx, "unsafe")
        fetcher, metrics, arrived = relay(ctx, f"{shm_root}/relay", [address])
        follow = asyncio.ensure_future(fetcher.run())
        await until(lambda: value(metrics, "offpolicy_messages_rejected_total", reason="bad_manifest") >= 2)
        follow.cancel()
        task.cancel()
        assert arrived == [] and "ChunkRequest" not in seen
        assert not os.path.exists(f"{shm_root}/relay/escape") and os.listdir(f"{shm_root}/relay/{RUN}") == []

    run(test)


def test_garbage_from_upstream_is_counted_then_the_fetcher_heals_to_the_next_one(shm_root):
    learner = WeightStore(f"{shm_root}/learner", RUN)
    path = publish(learner, 0)

    async def test(ctx):
        bad, bad_task, seen = await hostile(ctx, str(path))
        source = Source(ctx, learner.root)
        await source.end()
        fetcher, metrics, arrived = relay(ctx, f"{shm_root}/relay", [bad, source.address])
        await fetcher.run()
        bad_task.cancel()
        source.close()
        assert seen[0] == "RelayQuery" and "ChunkRequest" in seen
        assert value(metrics, "offpolicy_messages_rejected_total", reason="bad_message") >= CFG.window
        assert value(metrics, "offpolicy_relay_upstream_switches_total") == 1
        assert [v for v, _ in arrived] == [0]
        for name in os.listdir(path):
            assert (version_dir(f"{shm_root}/relay", RUN, 0) / name).read_bytes() == (path / name).read_bytes()

    run(test)


@pytest.mark.parametrize("latest_only, expected", [(False, [1, 2, 3]), (True, [1, 3])])
def test_latest_only_jumps_to_the_newest(shm_root, latest_only, expected):
    learner = WeightStore(f"{shm_root}/learner", RUN, keep=5)
    publish(learner, 1)

    async def test(ctx):
        cfg = msgspec.structs.replace(CFG, latest_only=latest_only)
        source, fetcher, metrics, arrived, follow = await following(ctx, shm_root, learner, cfg)
        await source.change(lambda: [publish(learner, 2), publish(learner, 3)])  # both before it hears of 2
        await source.end()
        await follow
        source.close()
        assert [v for v, _ in arrived] == expected

    run(test)
