"""deploy/grafana/offpolicy.json: a loadable dashboard whose queries read only metrics the daemons export."""

from __future__ import annotations

import json

from offpolicy.metrics import EvalMetrics, LearnerMetrics, RolloutMetrics
from offpolicy.relay.metrics import RelayMetrics
from tests.deploy.exprs import DASHBOARD, dashboard_exprs, names, recorded, rules, used_names

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> set[str]:
    """Sample names the daemons' registries export (counters with _total, histograms with their parts)."""
    out = {"up"}
    for metrics in (LearnerMetrics(), RolloutMetrics(), RelayMetrics(), EvalMetrics()):
        for family in metrics.registry.collect():
            out |= {family.name + s for s in _SUFFIXES[family.type]}
    return out


def test_dashboard_and_rules_read_only_exported_metrics_and_recorded_series():
    used = used_names()
    unknown = used - exported() - recorded()
    assert not unknown, f"not exported by offpolicy/metrics.py or offpolicy/relay/metrics.py: {sorted(unknown)}"
    assert len(used) > 40


def test_every_recorded_series_is_read_by_the_dashboard_or_another_rule():
    readers = names(dashboard_exprs() + [r["expr"] for r in rules()])
    assert recorded() - readers == set()


def test_dashboard_is_well_formed():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "run", "daemon"}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all('run=~"$run"' in t["expr"] for t in p["targets"]), p["title"]
    titles = " ".join(p["title"] for p in d["panels"]).lower()
    for topic in ("tokens", "reward", "loss", "kl", "staleness", "publish", "load", "queue", "up", "connected", "pass@k"):
        assert topic in titles, f"no panel about {topic}"
