"""The PromQL of deploy/: dashboard queries, recording and alerting rules, and the metric names they use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.deploy.conftest import DEPLOY

PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "offpolicy.json"
RULE_FILES = ("offpolicy.rules.yml", "offpolicy.alerts.yml")
# offpolicy metrics and recorded series (level:offpolicy_metric:operation), and Prometheus' own `up`
_NAME = re.compile(r"(?<![\w:])((?:[a-z]+:)?offpolicy_[a-z0-9_]+(?::[a-z0-9_]+)?|up(?=\{))")
# vLLM's own metrics (its servers' /metrics), and the names a real vLLM server exports (recorded, with its source)
_VLLM_NAME = re.compile(r"(?<![\w:])vllm:[a-z0-9_]+")
VLLM_METRICS = Path(__file__).with_name("vllm_metrics.txt")
# what Grafana substitutes in the dashboard's queries, as a test run has it
GRAFANA_VARS = {"$__rate_interval": "1m", "$run": ".+", "$daemon": ".+"}


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def grafana_query(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def rules() -> list[dict]:
    out = []
    for name in RULE_FILES:
        for group in yaml.safe_load((PROMETHEUS / name).read_text())["groups"]:
            out += group["rules"]
    return out


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def names(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in _NAME.findall(e)}


def used_names() -> set[str]:
    """Every metric and recorded series the dashboard and the rules read."""
    return names(dashboard_exprs() + [r["expr"] for r in rules()])


def vllm_names(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in _VLLM_NAME.findall(e)}


def vllm_exported() -> set[str]:
    """Sample names of a real vLLM server's /metrics, as recorded in vllm_metrics.txt."""
    return {line.strip() for line in VLLM_METRICS.read_text().splitlines() if line.strip() and not line.startswith("#")}


# offpolicy metrics only a rollout with a server engine exports (SGLang, vLLM: the prompt tokens its prefix cache held);
# a torch-engine quickstart has no data for them (tests/integration/test_sglang_daemons.py scrapes them from a daemon)
SERVER_ENGINE_ONLY = {"offpolicy_rollout_prompt_tokens_total"}


def server_engine_exprs() -> list[str]:
    """The dashboard queries that read only SERVER_ENGINE_ONLY metrics."""
    return [e for e in dashboard_exprs() if names([e]) and names([e]) <= SERVER_ENGINE_ONLY]


def vllm_exprs() -> list[str]:
    """The dashboard queries of the vLLM server panels."""
    return [e for e in dashboard_exprs() if vllm_names([e])]
