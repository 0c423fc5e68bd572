"""Tests for offpolicy.relay.node that need no sockets: where a node pulls from, and a source's check of the
learner's store layout against relay.sources (the daemon itself runs in tests/integration/test_relay*.py)."""

from __future__ import annotations

import logging

from offpolicy.config import load_config
from offpolicy.relay.node import RelayNode
from offpolicy.weights import WeightStore
from tests.conftest import QUICKSTART


def cfg(*overrides: str):
    return load_config(QUICKSTART, ["run.name=nodetest", "relay.port=5999", *overrides])


def test_relays_pull_from_the_relays_above_then_every_learner_nodes_source():
    one = RelayNode(cfg("relay.source=10.0.0.1"), 1, ["10.0.1.1", "10.0.1.2"])
    assert one.upstream_addrs == ["tcp://10.0.1.1:5999", "tcp://10.0.0.1:5999"] and one.source_addrs == []
    several = cfg("relay.sources=[10.0.0.1,10.0.0.2]")
    first = RelayNode(several, 0, ["10.0.1.1", "10.0.1.2"])
    assert first.upstream_addrs == [] and first.source_addrs == ["tcp://10.0.0.1:5999", "tcp://10.0.0.2:5999"]
    second = RelayNode(several, 1, ["10.0.1.1", "10.0.1.2"])
    assert second.upstream_addrs == ["tcp://10.0.1.1:5999"] and second.source_addrs == first.source_addrs
    source = RelayNode(several, -1, [], part=1)
    assert source.host == "10.0.0.2" and source.catalogs[0].run == "nodetest/node1"


def test_a_source_says_once_when_the_learners_store_disagrees_with_relay_sources(shm_root, caplog):
    WeightStore(shm_root, "nodetest/node0")  # a learner on several nodes committed node 0's parts here
    whole = RelayNode(cfg(f"weights.root={shm_root}", "relay.source=10.0.0.1"), -1, [])
    with caplog.at_level(logging.WARNING, logger="offpolicy.relay"):
        whole._check_layout()
        whole._check_layout()
    said = [r.getMessage() for r in caplog.records if "relay.sources" in r.getMessage()]
    assert len(said) == 1 and "list every learner node's host in relay.sources" in said[0]
    part = RelayNode(cfg(f"weights.root={shm_root}", "relay.sources=[10.0.0.1,10.0.0.2]"), -1, [], part=0)
    part._check_layout()
    assert not part._warned  # parts where parts are expected
    import torch

    WeightStore(shm_root, "nodetest").publish(0, iter({"w": torch.zeros(4)}.items()), {"model_type": "llama"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offpolicy.relay"):
        part._check_layout()
    assert part._warned and "holds whole versions" in caplog.text
