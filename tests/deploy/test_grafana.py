"""deploy/grafana/offpolicy.json: a loadable dashboard whose queries read only metrics the daemons export, and
vLLM metrics that a real vLLM server exports (tests/deploy/vllm_metrics.txt)."""

from __future__ import annotations

import json

from offpolicy.plumbing.metrics import EvalMetrics, LearnerMetrics, RolloutMetrics
from offpolicy.relay.metrics import RelayMetrics
from tests.deploy.exprs import (DASHBOARD, dashboard_exprs, names, recorded, rules, used_names, vllm_exported, vllm_names)

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
    assert not unknown, f"not exported by offpolicy/plumbing/metrics.py or offpolicy/relay/metrics.py: {sorted(unknown)}"
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
    for topic in ("tokens", "reward", "loss", "kl", "staleness", "publish", "load", "queue", "up", "connected", "pass@k",
                  "vllm: requests running and waiting", "vllm: kv-cache", "vllm: time to first token", "vllm: request latency"):
        assert topic in titles, f"no panel about {topic}"


def test_vllm_panels_read_only_metrics_a_real_vllm_server_exports():
    used = vllm_names(dashboard_exprs())
    assert len(vllm_exported()) > 100  # the recorded list is whole (a real server: ~110 names)
    unknown = used - vllm_exported()
    assert not unknown, f"not among the names a real vLLM server exports (tests/deploy/vllm_metrics.txt): {sorted(unknown)}"
    # the panels users expect: running/waiting requests, KV-cache use, generation tokens/s, TTFT, request latency
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket"} <= used
    assert not used_names() & used  # vLLM's names are not taken for offpolicy's

