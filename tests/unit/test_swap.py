"""offpolicy/rollout/swap.py: what the weight swapper records of versions an engine switched to in flight."""

import types
from pathlib import Path

from offpolicy.config import load_config
from offpolicy.plumbing.metrics import RolloutMetrics
from offpolicy.rollout.engines.double_buffer import PrefetchRecord
from offpolicy.rollout.swap import WeightSwapper

REPO = Path(__file__).resolve().parents[2]


class Tracer:
    def __init__(self):
        self.spans = []

    def add(self, name, began, seconds, **args):
        self.spans.append((name, began, seconds, args))


def test_each_switch_in_flight_counts_its_servers_loads_by_proof_and_is_traced_as_a_load():
    """rollout.inflight_updates on vLLM servers: a switch during a generate call is a load of each server like one
    between calls (`offpolicy_weight_loads_total{method, proven}`, the bench's `loads proven`), observed and traced
    for as long as it held the generation."""
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [])
    m, tracer = RolloutMetrics(), Tracer()
    records = [PrefetchRecord(4, "superseded"),
               PrefetchRecord(5, "swapped", seconds=1.2, began=10.0, inflight=True, swapped_at=12.0, swap_seconds=0.3,
                              proofs=(("inplace", True), ("inplace", True))),
               PrefetchRecord(6, "swapped", seconds=1.1, began=13.0, inflight=True, swapped_at=15.0, swap_seconds=0.2,
                              proofs=(("inplace", True), ("rebuild", False))),
               PrefetchRecord(7, "unstaged", inflight=True, swapped_at=17.0, swap_seconds=0.5,
                              proofs=(("inplace", True),))]  # read at the switch (prefetch=direct)
    prefetcher = types.SimpleNamespace(drain=lambda: records, prefetch=lambda wv: None)
    swapper = WeightSwapper(cfg, engine=None, metrics=m, announce="tcp://127.0.0.1:1", tracer=tracer,
                            prefetcher=prefetcher)
    try:
        assert swapper._prefetched() == 1.1  # the newest swapped version's background seconds

        def loads(method, proven):
            return m.registry.get_sample_value("offpolicy_weight_loads_total", {"method": method, "proven": proven})

        assert (loads("inplace", "true"), loads("rebuild", "false")) == (4.0, 1.0)
        assert m.registry.get_sample_value("offpolicy_weight_load_seconds_count") == 3.0
        assert [(s[0], s[1], s[2], s[3].get("inflight")) for s in tracer.spans if s[0] == "load"] == [
            ("load", 12.0, 0.3, True), ("load", 15.0, 0.2, True), ("load", 17.0, 0.5, True)]
        assert [s[3]["version"] for s in tracer.spans if s[0] == "prefetch"] == [5, 6]  # nothing ahead for 7
        assert m.registry.get_sample_value("offpolicy_weight_prefetches_total", {"outcome": "unstaged"}) == 1.0
    finally:
        swapper.close()
