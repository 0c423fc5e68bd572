"""Tests for offpolicy.relay.server and catalog over real ZeroMQ sockets and a real store in /dev/shm:
offers (at once, parked until a version appears, expired), chunks byte for byte, parked chunks of a
version still being received, refusals that are counted and answered without stopping the server,
and versions held while served so that the learner's collector leaves them in place."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from offpolicy.relay.catalog import Catalog
from offpolicy.relay.incoming import Incoming, parse_manifest
from offpolicy.relay.metrics import RelayMetrics
from offpolicy.relay.server import ShardServer
from offpolicy.weights import WeightStore, list_versions, version_dir
from offpolicy.weights.store import MANIFEST
from offpolicy.wire import protocol

RUN = "srv"


def publish(store: WeightStore, version: int, n: int = 40_000) -> Path:
    g = torch.Generator().manual_seed(version)
    store.publish(version, iter({"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)}.items()),
                  {"model_type": "llama"})
    return version_dir(store.root, RUN, version)


class Client:
    """A downstream relay's DEALER, speaking the protocol by hand."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def ask(self, msg: protocol.Message, timeout: float = 5.0):
        await self.sock.send_multipart(protocol.encode(msg))
        return await self.reply(timeout)

    async def reply(self, timeout: float = 5.0):
        if not await self.sock.poll(int(timeout * 1000)):
            return None
        return protocol.decode(await self.sock.recv_multipart())


def serve(root: str, test, catalog_root: str | None = None, part: int | None = None) -> None:
    """Run `test(server, client, ctx)` against a ShardServer on the store at `root` (learner node `part`'s part)."""

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        server = ShardServer(router, Catalog(catalog_root or root, RUN, idle_s=0.2, part=part), RelayMetrics())
        task = asyncio.ensure_future(server.serve_forever())
        client = Client(ctx, f"tcp://127.0.0.1:{port}")
        try:
            await test(server, client, ctx)
        finally:
            task.cancel()
            server.catalog.close()
            ctx.destroy(0)

    asyncio.run(main())


def rejected(server: ShardServer, reason: str) -> float:
    return server.metrics.registry.get_sample_value("offpolicy_messages_rejected_total", {"reason": reason}) or 0.0


def test_offers_lowest_or_newest_with_the_manifest_bytes(shm_root):
    store = WeightStore(shm_root, RUN, keep=5)
    paths = [publish(store, v) for v in range(3)]

    async def test(server, client, ctx):
        msg, _ = await client.ask(protocol.RelayQuery(want=1))
        assert (msg.version, msg.newest, msg.ended) == (1, 2, False)
        assert msg.manifest == (paths[1] / MANIFEST).read_bytes()
        msg, _ = await client.ask(protocol.RelayQuery(want=0, latest=True))
        assert msg.version == 2 and msg.manifest == (paths[2] / MANIFEST).read_bytes()
        msg, _ = await client.ask(protocol.RelayQuery(want=3, wait_s=0))
        assert (msg.version, msg.newest) == (-1, 2)

    serve(shm_root, test)


def test_a_parked_query_is_answered_when_the_version_appears_or_when_it_expires(shm_root):
    store = WeightStore(shm_root, RUN)
    publish(store, 0)

    async def test(server, client, ctx):
        await client.sock.send_multipart(protocol.encode(protocol.RelayQuery(want=1, wait_s=30)))
        assert await client.reply(timeout=0.3) is None  # parked
        publish(store, 1)
        await server.wake()
        msg, _ = await client.reply()
        assert msg.version == 1
        await client.sock.send_multipart(protocol.encode(protocol.RelayQuery(want=2, wait_s=0.2)))
        assert await client.reply(timeout=0.1) is None
        await asyncio.sleep(0.25)
        await server.wake()  # the daemon's housekeeping does this every 0.1 s
        msg, _ = await client.reply()
        assert msg.version == -1 and not msg.ended
        server.catalog.ended = True
        msg, _ = await client.ask(protocol.RelayQuery(want=2, wait_s=30))  # over: answered at once
        assert msg.version == -1 and msg.ended

    serve(shm_root, test)


def test_chunks_are_the_file_bytes_and_bytes_out_are_counted(shm_root):
    store = WeightStore(shm_root, RUN)
    path = publish(store, 0)
    shard = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    data = shard.read_bytes()

    async def test(server, client, ctx):
        for off, n in [(0, 1000), (1000, 65536), (len(data) - 10, 10), (5, 0)]:
            msg, arrays = await client.ask(protocol.ChunkRequest(version=0, file=shard.name, offset=off, length=n))
            assert isinstance(msg, protocol.Chunk) and (msg.offset, msg.length) == (off, n)
            assert arrays[0].tobytes() == data[off: off + n]
        out = server.metrics.registry.get_sample_value("offpolicy_relay_bytes_total", {"direction": "out"})
        assert out == 1000 + 65536 + 10

    serve(shm_root, test)


@pytest.mark.parametrize("checksum", ["sha256", "none"])
def test_chunks_of_a_file_without_a_sha256_carry_the_crc32_of_their_bytes(shm_root, checksum):
    path = publish(WeightStore(shm_root, RUN, checksum=checksum), 0)
    shard = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    data = shard.read_bytes()

    async def test(server, client, ctx):
        for off, n in [(0, 1000), (1000, 65536), (5, 0), (0, 1000)]:  # the last one again: from the cache
            msg, arrays = await client.ask(protocol.ChunkRequest(version=0, file=shard.name, offset=off, length=n))
            assert arrays[0].tobytes() == data[off: off + n]
            assert msg.crc32 == (zlib.crc32(data[off: off + n]) if checksum == "none" else None)

    serve(shm_root, test)


def test_bad_requests_are_refused_counted_and_the_server_goes_on(shm_root):
    store = WeightStore(shm_root, RUN)
    path = publish(store, 0)
    shard = next(p.name for p in path.iterdir() if p.suffix == ".safetensors")
    size = (path / shard).stat().st_size

    async def test(server, client, ctx):
        cases = [
            (protocol.ChunkRequest(version=0, file="nope.bin", offset=0, length=1), "bad_request"),
            (protocol.ChunkRequest(version=0, file=shard, offset=size - 1, length=2), "bad_request"),
            (protocol.ChunkRequest(version=0, file=shard, offset=-1, length=1), "bad_request"),
            (protocol.WorkRequest(credits=3), "unexpected"),
        ]
        for msg, reason in cases:
            got, _ = await client.ask(msg)
            assert isinstance(got, protocol.Error) and got.code == reason
        for frames, reason in [([b"\x00garbage"], "bad_message"), ([b"", b"x"], "bad_message"),
                               ([msgspec.msgpack.encode({"type": "relay?", "proto": 99, "want": 0})],
                                "protocol_version")]:
            await client.sock.send_multipart(frames)
            got, _ = await client.reply()
            assert isinstance(got, protocol.Error) and got.code == reason
        assert rejected(server, "bad_request") == 3 and rejected(server, "bad_message") == 2
        assert rejected(server, "protocol_version") == 1 and rejected(server, "unexpected") == 1
        got, _ = await client.ask(protocol.ChunkRequest(version=7, file=shard, offset=0, length=1))
        assert isinstance(got, protocol.RelayMissing) and got.version == 7
        got, arrays = await client.ask(protocol.ChunkRequest(version=0, file=shard, offset=0, length=8))
        assert isinstance(got, protocol.Chunk) and arrays[0].tobytes() == (path / shard).read_bytes()[:8]

    serve(shm_root, test)


def test_chunks_of_a_version_being_received_wait_for_their_bytes(shm_root):
    source = WeightStore(f"{shm_root}/learner", RUN)
    path = publish(source, 4, n=100_000)
    raw = (path / MANIFEST).read_bytes()
    relay = WeightStore(f"{shm_root}/relay", RUN)
    chunk = 64 * 1024

    async def test(server, client, ctx):
        with pytest.raises(RuntimeError), relay.stage(4) as tmp:
            inc = Incoming(tmp, 4, raw, parse_manifest(raw, 4), chunk)
            server.catalog.incoming = inc
            msg, _ = await client.ask(protocol.RelayQuery(want=0, latest=True))
            assert msg.version == 4 and msg.manifest == raw  # offered before a single byte is here
            name, off, n = inc.chunks()[1]
            data = (path / name).read_bytes()[off: off + n]
            assert await client.ask(protocol.ChunkRequest(version=4, file=name, offset=off, length=n), 0.3) is None
            inc.write(name, off, data)
            await server.arrived(4, name)
            got, arrays = await client.reply()
            assert isinstance(got, protocol.Chunk) and arrays[0].tobytes() == data
            name, off, n = inc.chunks()[2]
            assert await client.ask(protocol.ChunkRequest(version=4, file=name, offset=off, length=n), 0.3) is None
            await server.dropped(4, "refused upstream")
            got, _ = await client.reply()
            assert isinstance(got, protocol.RelayMissing) and got.version == 4
            inc.close()
            server.catalog.incoming = None
            raise RuntimeError("abandon the version")

    serve(f"{shm_root}/relay", test)


def test_a_served_version_is_held_against_the_collector_until_idle(shm_root):
    store = WeightStore(shm_root, RUN, keep=2)
    publish(store, 0)

    async def test(server, client, ctx):
        msg, _ = await client.ask(protocol.RelayQuery(want=0))
        assert msg.version == 0
        publish(store, 1)
        publish(store, 2)  # collects: v0 is beyond keep, but a downstream relay is fetching it
        assert list_versions(shm_root, RUN) == [0, 1, 2]
        await asyncio.sleep(0.3)
        server.catalog.release_idle()  # nobody asked for 0.3 s > idle_s
        assert store.collect() == [0]

    serve(shm_root, test)


def test_bytes_for_a_peer_that_left_are_dropped_not_counted(shm_root):
    source = WeightStore(f"{shm_root}/learner", RUN)
    path = publish(source, 4)
    raw = (path / MANIFEST).read_bytes()
    relay = WeightStore(f"{shm_root}/relay", RUN)

    async def test(server, client, ctx):
        with pytest.raises(RuntimeError), relay.stage(4) as tmp:
            inc = Incoming(tmp, 4, raw, parse_manifest(raw, 4), 64 * 1024)
            server.catalog.incoming = inc
            name, off, n = inc.chunks()[0]
            assert await client.ask(protocol.ChunkRequest(version=4, file=name, offset=off, length=n), 0.3) is None
            client.sock.close(0)  # the downstream relay dies with its request parked here
            await asyncio.sleep(0.3)
            inc.write(name, off, (path / name).read_bytes()[off: off + n])
            await server.arrived(4, name)  # the reply has nowhere to go: dropped, the server goes on
            out = server.metrics.registry.get_sample_value("offpolicy_relay_bytes_total", {"direction": "out"})
            assert out == 0
            inc.close()
            server.catalog.incoming = None
            raise RuntimeError("abandon the version")
        other = Client(ctx, server.sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        got, _ = await other.ask(protocol.RelayQuery(want=0, wait_s=0))
        assert got.version == -1

    serve(f"{shm_root}/relay", test)


def test_each_format_is_served_from_its_own_store_and_an_unrelayed_one_is_refused(shm_root):
    native, fp8 = WeightStore(shm_root, RUN), WeightStore(shm_root, f"{RUN}/fp8", fmt="fp8")
    publish(native, 0)
    publish(native, 1)
    fp8.publish(1, iter({"w": torch.ones(8, 8).to(torch.float8_e4m3fn)}.items()), {"model_type": "llama"})

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        server = ShardServer(router, Catalog(shm_root, RUN, idle_s=5), RelayMetrics(),
                             Catalog(shm_root, RUN, idle_s=5, fmt="fp8"))
        task = asyncio.ensure_future(server.serve_forever())
        client = Client(ctx, f"tcp://127.0.0.1:{port}")
        try:
            msg, _ = await client.ask(protocol.RelayQuery(want=0, format="fp8"))
            assert msg.version == 1 and b'"format":"fp8"' in msg.manifest  # fp8 holds only version 1
            msg, _ = await client.ask(protocol.RelayQuery(want=0))
            assert msg.version == 0
            name = next(n for n in fp8_files() if n.endswith(".safetensors"))
            msg, arrays = await client.ask(protocol.ChunkRequest(version=1, file=name, offset=0, length=8, format="fp8"))
            assert isinstance(msg, protocol.Chunk) and arrays[0].tobytes() == (version_dir(shm_root, f"{RUN}/fp8", 1) / name).read_bytes()[:8]
            msg, _ = await client.ask(protocol.RelayQuery(want=0, format="mxfp4"))
            assert isinstance(msg, protocol.Error) and "'mxfp4' is not relayed here" in msg.message
            assert rejected(server, "bad_request") == 1
        finally:
            task.cancel()
            for c in server.catalogs.values():
                c.close()
            ctx.destroy(0)

    def fp8_files():
        return [f.name for f in version_dir(shm_root, f"{RUN}/fp8", 1).iterdir()]

    asyncio.run(main())


def test_a_learner_nodes_source_offers_its_part_with_the_whole_manifest_and_serves_only_its_files(shm_root):
    """Several learner nodes: node 1's part of a version (`<run>/node1/v0`, its shards and the whole manifest,
    whose index and config.json are node 0's) is offered as the version; its own shard is served, a file of
    node 0 is refused naming relay.sources, and a version of the run's own store is not this source's."""
    publish(WeightStore(shm_root, RUN), 5)  # a whole version beside the parts: never offered by a part's source
    part = version_dir(shm_root, f"{RUN}/node1", 0)
    store = WeightStore(shm_root, f"{RUN}/node1")
    store.publish(0, iter({"w": torch.randn(40_000)}.items()), {"model_type": "llama"})
    from offpolicy.weights.store import read_manifest

    m = read_manifest(part)
    shard = next(n for n in m.files if n.endswith(".safetensors"))
    m.files[shard].node = 1
    m.nodes = 2
    raw = msgspec.json.encode(m)
    (part / MANIFEST).write_bytes(raw)

    async def test(server, client, ctx):
        msg, _ = await client.ask(protocol.RelayQuery(want=0, latest=True))
        assert (msg.version, msg.manifest) == (0, raw)
        msg, arrays = await client.ask(protocol.ChunkRequest(version=0, file=shard, offset=0, length=1000))
        assert isinstance(msg, protocol.Chunk) and bytes(arrays[0]) == (part / shard).read_bytes()[:1000]
        msg, _ = await client.ask(protocol.ChunkRequest(version=0, file="config.json", offset=0, length=10))
        assert isinstance(msg, protocol.Error) and msg.code == "bad_request"
        assert "learner node 0's" in msg.message and "relay.sources" in msg.message
        assert rejected(server, "bad_request") == 1
        msg, _ = await client.ask(protocol.RelayQuery(want=1, wait_s=0))
        assert msg.version == -1  # the run's whole version 5 is not in this part

    serve(shm_root, test, part=1)
