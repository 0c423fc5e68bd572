"""A learner on several nodes, through the relay: real `offpolicy-relay` daemons, two store roots standing
in for two learner nodes (each with its source, `--serve --index k`, `relay.sources`) and one rollout
node's relay, each "node" with its own address. Each learner node holds only its part of a version
(`<store>/node<k>/v<N>`, written by the sharded publish); the rollout node's relay must assemble the
version from both, bit for bit what the parts make together (`weights/parts.assemble`), in every format,
and announce it to the node's subscribers; with one learner node's source down no version may appear, and
it must appear once that source is back. `pytest -k sharded_publish` selects these tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from offpolicy.weights import WeightVersion, list_versions, subscribe
from offpolicy.weights.parts import assemble
from offpolicy.weights.store import read_manifest
from offpolicy.wire import protocol
from tests.integration.helpers import wait_for
from tests.parts_writer import PartsWriter, parts, tensors
from tests.relay_nodes import RUN, PartsCluster, digests

FAST = ("relay.linger_s=1", "relay.peer_timeout_s=1", "relay.chunk_bytes=65536", "run.log_level=DEBUG",
        "weights.formats=[fp8]")
STORES = {"native": RUN, "fp8": f"{RUN}/fp8"}


@pytest.fixture
def parts_cluster(shm_root, tmp_path):
    made: list[PartsCluster] = []

    def make(roots: list[str], *overrides: str, run: str = RUN) -> PartsCluster:
        c = PartsCluster(roots, 1, Path(shm_root), tmp_path, *FAST, *overrides, run=run)
        made.append(c)
        c.start_all()
        return c

    yield make
    for c in made:
        c.close()


def whole(roots: list[str], store: str, version: int, dest: Path) -> dict[str, str]:
    """sha256 of every file of the version the learner nodes' parts make together (assembled locally)."""
    out = dest / store / f"v{version}"
    assemble(parts(roots, store, version), out)
    return digests(out)


def holds(root: str, version: int) -> bool:
    return all(version in list_versions(root, s) for s in STORES.values())


def served_bytes(roots: list[str], node: int, versions: list[int]) -> int:
    """Bytes of the files learner node `node` holds for these versions, every format (its source's share)."""
    return sum(e.bytes for s in STORES.values() for v in versions
               for e in read_manifest(parts(roots, s, v)[0]).files.values() if e.node == node)


def test_sharded_publish_from_two_nodes_reaches_a_rollout_node_whole_and_never_without_every_part(
        shm_root, tmp_path, parts_cluster):
    roots = [str(Path(shm_root) / "learner-a"), str(Path(shm_root) / "learner-b")]
    writer = PartsWriter(roots, RUN, ["native", "fp8"], tmp_path / "ctl")
    try:
        c = parts_cluster(roots)
        rollout = c.relay_roots[0]
        seen: list[int] = []
        follower_tensors: dict[int, dict[str, torch.Tensor]] = {}

        def follow():  # the public subscribe API on the rollout node's store and its relay's PUB
            for wv in subscribe(rollout, RUN, announce=f"tcp://{c.relay_hosts[0]}:{c.announce_port}",
                                 latest_only=False, verify=True, timeout_s=90):
                follower_tensors[wv.version] = {k: t.clone() for k, t in wv.tensors.items()}
                seen.append(wv.version)

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        time.sleep(0.3)  # subscribed

        writer.write(0)
        for s in STORES.values():  # the learner nodes hold parts only: no store there has a version
            assert list_versions(roots[0], s) == list_versions(roots[1], s) == []
        c.announce_version(0)
        wait_for(lambda: holds(rollout, 0), 60, "the rollout node holding version 0 in every format")
        for fmt, s in STORES.items():  # bit for bit the version the parts make, manifest included
            assert digests(Path(rollout) / s / "v0") == whole(roots, s, 0, tmp_path / "whole"), fmt
        manifest = read_manifest(Path(rollout) / RUN / "v0")
        assert manifest.nodes == 2 and {e.node for e in manifest.files.values()} == {0, 1}
        wait_for(lambda: 0 in seen, 30, "the rollout node's subscriber seeing version 0")
        want = {**tensors(0, 0), **tensors(1, 0)}
        assert set(follower_tensors[0]) == set(want)
        for name, x in want.items():
            assert torch.equal(follower_tensors[0][name], x), name

        c.stop("source1")  # learner node 1's source dies: its part of version 1 cannot be had
        writer.write(1)
        c.announce_version(1)
        wait_for(lambda: "waiting for the part of node(s) [1]" in c.log("relay0"), 30,
                 "the relay saying it waits for node 1's part")
        time.sleep(1.5)
        for s in STORES.values():
            assert list_versions(rollout, s) == [0], "a version appeared without learner node 1's part"
        assert c.procs["relay0"].poll() is None and seen == [0]
        assert "learner node 1's source" in c.log("relay0")

        c.start_source(1)  # back: the version appears, whole
        wait_for(lambda: holds(rollout, 1), 60, "the rollout node holding version 1 once node 1's source is back")
        for fmt, s in STORES.items():
            assert digests(Path(rollout) / s / "v1") == whole(roots, s, 1, tmp_path / "whole"), fmt
        wait_for(lambda: seen == [0, 1], 30, "the subscriber seeing version 1")
        with WeightVersion(Path(rollout) / RUN / "fp8" / "v1", verify=True) as wv:
            assert wv.manifest.format == "fp8" and wv.manifest.nodes == 2
            assert wv.tensors["model.layers.4.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn

        m = c.metrics("relay0")
        assert m['offpolicy_relay_versions_total{outcome="complete"}'] == 4  # 2 versions x 2 formats
        assert m["offpolicy_relay_checksum_failures_total"] == 0
        assert m["offpolicy_relay_weight_version"] == 1
        assert m['offpolicy_relay_bytes_total{direction="in"}'] == sum(served_bytes(roots, k, [0, 1]) for k in (0, 1))
        # learner node 0's source served its own files, once (unless the relay re-asked it after a timeout)
        out0, share0 = c.metrics("source0")['offpolicy_relay_bytes_total{direction="out"}'], served_bytes(roots, 0, [0, 1])
        assert out0 == share0 or ("learner node 0's source" in c.log("relay0") and share0 <= out0 <= 2 * share0)

        c.announce(protocol.Goodbye(reason="done"))
        for name in ("source0", "source1", "relay0"):
            assert c.procs[name].wait(30) == 0, c.log(name)
        t.join(10)
        assert seen == [0, 1] and not t.is_alive()  # ended on the relayed goodbye
    finally:
        writer.close()


@pytest.mark.slow
def test_sharded_publish_by_megatron_on_two_nodes_is_assembled_by_the_relays_bit_for_bit(shm_root, tmp_path):
    """The parts of a real Megatron learner (4 gloo ranks, TP 2 x PP 2, ranks 0-1 node a, 2-3 node b, as
    tests/unit/test_weights_sharded.py writes them) through two sources and a chain of two rollout-node
    relays: each node's version is the gathered model, tensor for tensor and bit for bit, in every format."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from tests.megatron_workers import overrides
    from tests.shard_workers import RUN as SHARD_RUN
    from tests.shard_workers import compare, spawn_publish

    roots = [str(Path(shm_root) / "learner-a"), str(Path(shm_root) / "learner-b")]
    fmts = ["native", "fp8"]
    result = spawn_publish(4, overrides("llama", "learner.megatron.tp=2", "learner.megatron.pp=2"), roots, fmts,
                           str(tmp_path / "out.pt"), versions=1, nodes=["a", "a", "b", "b"])
    stores = {"native": SHARD_RUN, "fp8": f"{SHARD_RUN}/fp8"}
    c = PartsCluster(roots, 2, Path(shm_root), tmp_path, *FAST, run=SHARD_RUN)
    try:
        c.start_all()
        c.announce_version(0)  # the parts were there first: the relays may have it before this
        wait_for(lambda: all(0 in list_versions(r, s) for r in c.relay_roots for s in stores.values()), 60,
                 "both rollout nodes holding version 0 in every format")
        for fmt, s in stores.items():
            want = whole(roots, s, 0, tmp_path / "whole")
            for r in c.relay_roots:
                assert digests(Path(r) / s / "v0") == want, (r, fmt)
        for r in c.relay_roots:
            got = compare(r, 0, result["results"][0]["gathered"], result["hf_config"], fmts)
            for fmt in fmts:
                assert (got[fmt]["missing"], got[fmt]["extra"], got[fmt]["differ"]) == ([], [], []), (r, fmt)
                assert got[fmt]["config"], (r, fmt)
        # relay 1 pulled whole versions from relay 0: each learner node's source served its files once
        for k in range(2):
            share = sum(e.bytes for s in stores.values()
                        for e in read_manifest(parts(roots, s, 0)[0]).files.values() if e.node == k)
            out = c.metrics(f"source{k}")['offpolicy_relay_bytes_total{direction="out"}']
            assert out == share or (f"learner node {k}'s source" in c.log("relay0") and share <= out <= 2 * share)
        c.announce(protocol.Goodbye(reason="done"))
        for name in ("source0", "source1", "relay0", "relay1"):
            assert c.procs[name].wait(30) == 0, c.log(name)
    finally:
        c.close()


def test_sharded_publish_relayed_down_a_chain_heals_to_the_learner_nodes_sources_when_relay_0_dies(
        shm_root, tmp_path):
    """Relay 1 pulls whole versions from relay 0; relay 0 killed mid-transfer, relay 1 re-attaches to the
    learner nodes' sources (there is no relay above) and asks each for the chunks of its part still missing."""
    roots = [str(Path(shm_root) / "learner-a"), str(Path(shm_root) / "learner-b")]
    writer = PartsWriter(roots, RUN, ["native"], tmp_path / "ctl", shape=(1024, 1024))  # 24 MiB a version
    c = PartsCluster(roots, 2, Path(shm_root), tmp_path, *FAST, "weights.formats=[]", "relay.window=1",
                     "relay.chunk_bytes=131072")
    try:
        c.start_all()
        writer.write(0)
        c.announce_version(0)
        staging = lambda i: list((Path(c.relay_roots[i]) / RUN).glob(".v0.tmp-*"))  # noqa: E731
        wait_for(lambda: staging(1) and not list_versions(c.relay_roots[0], RUN), 60,
                 "relay 1 pulling version 0 from relay 0", 0.005)
        c.stop("relay0")
        assert list_versions(c.relay_roots[0], RUN) == [], "relay 0 finished before it was killed: nothing proved"
        wait_for(lambda: list_versions(c.relay_roots[1], RUN) == [0], 60, "relay 1 holding version 0")
        assert digests(Path(c.relay_roots[1]) / RUN / "v0") == whole(roots, RUN, 0, tmp_path / "whole")
        assert "re-attaching to the learner nodes' sources" in c.log("relay1")
        assert c.metrics("relay1")["offpolicy_relay_upstream_switches_total"] == 1
        writer.write(1)  # the healed relay stays on the sources
        c.announce_version(1)
        wait_for(lambda: list_versions(c.relay_roots[1], RUN) == [0, 1], 60, "relay 1 holding version 1")
        assert digests(Path(c.relay_roots[1]) / RUN / "v1") == whole(roots, RUN, 1, tmp_path / "whole")
        c.seen.poll()
        assert c.seen.seen[1] == [0, 1]
    finally:
        c.close()
        writer.close()
