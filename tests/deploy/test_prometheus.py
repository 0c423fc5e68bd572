"""deploy/prometheus: promtool finds the config and rules clean and the rule unit tests pass; a real
Prometheus (Debian's package) scraping a running quickstart and a weight relay answers every query the
dashboard and the rules make; one scraping a real vLLM server (scrape job `vllm`) answers every query of
the dashboard's vLLM panels."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART, ROOT, free_ports
from tests.deploy.conftest import DEPLOY, need, port_block, which
from tests.deploy.exprs import (PROMETHEUS, RULE_FILES, SERVER_ENGINE_ONLY, dashboard_exprs, grafana_query,
                                server_engine_exprs, used_names, vllm_exprs)
from tests.integration.helpers import stop_all, wait_for


def promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    need("promtool", package="prometheus")
    r = subprocess.run([which("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def prometheus_dir(tmp_path: Path, interval: str = "15s") -> Path:
    """deploy/prometheus's config and rules in `tmp_path`, scraping and evaluating every `interval`."""
    d = tmp_path / "prometheus"
    (d / "targets").mkdir(parents=True)
    cfg = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    for name in RULE_FILES:
        shutil.copy(PROMETHEUS / name, d / name)
    return d


def test_promtool_finds_config_and_rules_clean(tmp_path):
    promtool("check", "rules", *RULE_FILES)
    d = prometheus_dir(tmp_path)
    (d / "targets" / "job.json").write_text("[]")
    out = promtool("check", "config", "prometheus.yml", cwd=d)
    assert "WARNING" not in out, out
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")  # as shipped (no job running: no targets)


def test_rule_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "rules_test.yml")


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
def test_a_real_prometheus_has_data_for_every_query_of_the_dashboard_and_the_rules(tmp_path, shm_root):
    need("prometheus", "promtool", package="prometheus")
    work, announce, relay_port, relay_announce, relay_metrics, prom_port = free_ports(6)
    metrics = port_block(4)
    # the eval daemon (metrics.port + 3) evaluates every 50th version of a small held-out set
    run = [f"run.dir={tmp_path / 'runs'}", f"weights.root={shm_root}", f"transport.work_port={work}",
           f"transport.announce_port={announce}", f"metrics.port={metrics}", "eval.every_versions=50",
           "eval.data.synthetic={task: copy, length: 4, num_prompts: 8, seed: 1}", "eval.n_samples=4", "eval.k=[1, 4]"]
    d = prometheus_dir(tmp_path, interval="1s")
    targets = d / "targets" / "quickstart.json"
    r = subprocess.run([sys.executable, str(DEPLOY / "slurm" / "plan.py"), "targets", "--config", QUICKSTART, *run,
                        "--out", str(targets)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # one relay "node" at 127.0.0.2 pulling from a source beside the learner, as on a cluster
    relay_common = ["--config", QUICKSTART, *run, "relay.nodes=[127.0.0.2]", "relay.source=127.0.0.1",
                    f"relay.port={relay_port}", f"relay.announce_port={relay_announce}",
                    f"relay.metrics_port={relay_metrics}"]
    relays = {"relay-source": ["--serve", "metrics.host=127.0.0.1"],
              "relay-0": ["--index", "0", "metrics.host=127.0.0.2", f"weights.root={tmp_path / 'relay-store'}"]}
    entries = json.loads(targets.read_text())
    for name, host in (("relay-source", "127.0.0.1"), ("relay-0", "127.0.0.2")):
        entries.append({"targets": [f"{host}:{relay_metrics}"], "labels": {**entries[0]["labels"], "daemon": name,
                                                                          "role": "relay", "node": host}})
    targets.write_text(json.dumps(entries))
    assert "WARNING" not in promtool("check", "config", "prometheus.yml", cwd=d)

    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []

    def start(name: str, cmd: list[str]) -> None:
        procs.append(subprocess.Popen(cmd, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT))

    try:
        start("run", [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *run,
                      "learner.total_steps=3000"])
        for name, args in relays.items():
            start(name, [sys.executable, "-m", "offpolicy.services.relay", *relay_common, *args])
        start("prometheus", [which("prometheus"), f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"])
        steps = tmp_path / "runs" / "quickstart" / "metrics.jsonl"
        wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 10, 120, "10 training steps")
        up = 'count(up{job="offpolicy"} == 1)'
        wait_for(lambda: [r["value"][1] for r in query(prom_port, up)] == ["6"], 60, "6 targets up (learner, "
                 "2 rollouts, eval, relay source, relay)")

        # (a torch-engine quickstart: the server engines' own counters have no data, SERVER_ENGINE_ONLY)
        wanted = sorted(used_names() - SERVER_ENGINE_ONLY) + [grafana_query(e) for e in dashboard_exprs()
                                                             if e not in vllm_exprs() + server_engine_exprs()]
        missing = wanted
        deadline = time.monotonic() + 90
        while missing and time.monotonic() < deadline:
            missing = [q for q in missing if not query(prom_port, q)]
            time.sleep(2)
        assert procs[0].poll() is None, "the quickstart ended before every query had data; raise total_steps"
        assert not missing, f"no data in Prometheus for: {missing}"
    finally:
        stop_all(procs)
    for name in ("run", "relay-source", "relay-0"):
        assert "Traceback" not in (logs / f"{name}.log").read_text(), (logs / f"{name}.log").read_text()[-3000:]


@pytest.mark.slow
def test_a_real_prometheus_scraping_a_real_vllm_server_has_data_for_every_vllm_panel(tmp_path):
    """The vLLM server `offpolicy run` and the Slurm step launch (quickstart-vllm's model), listed by
    plan.py targets and scraped by the job `vllm` (the daemons' job `offpolicy` drops it); requests go
    to it until every vLLM panel's query has data."""
    need("prometheus", "promtool", package="prometheus")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: bash deploy/vllm/install-cpu.sh (docs/vllm.md)")
    import torch

    from offpolicy.config import load_config
    from offpolicy.models.build import build_model
    from offpolicy.rollout.engines.vllm.launch import server_command, server_env

    server, metrics, prom_port = free_ports(3)
    run = [f"rollout.vllm.server_port={server}", f"metrics.port={metrics}", "run.rollouts=1"]
    config = str(ROOT / "configs" / "quickstart-vllm.yaml")
    cfg = load_config(config, run)
    model = tmp_path / "model"
    build_model(cfg.model, torch.device("cpu")).save_pretrained(model)
    d = prometheus_dir(tmp_path, interval="1s")
    r = subprocess.run([sys.executable, str(DEPLOY / "slurm" / "plan.py"), "targets", "--config", config, *run,
                        "--out", str(d / "targets" / "run.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    env = {**os.environ, **server_env(), "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    logs = {name: tmp_path / f"{name}.log" for name in ("vllm", "prometheus")}
    procs = [subprocess.Popen(server_command(cfg, str(model), 0, on_cpu=True), env=env,
                              stdout=open(logs["vllm"], "w"), stderr=subprocess.STDOUT),
             subprocess.Popen([which("prometheus"), f"--config.file={d / 'prometheus.yml'}",
                               f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                              stdout=open(logs["prometheus"], "w"), stderr=subprocess.STDOUT)]
    base = f"http://127.0.0.1:{server}"

    def healthy() -> bool:
        assert procs[0].poll() is None, logs["vllm"].read_text()[-3000:]
        try:
            return urllib.request.urlopen(base + "/health", timeout=5).status == 200
        except OSError:
            return False

    def generate(i: int) -> None:
        body = {"token_ids": [11, 1, 2, 3, 4, 12], "request_id": f"metrics-{i}", "output_mode": "tokens",
                "sampling_params": {"n": 4, "max_tokens": 6, "temperature": 1.0, "logprobs": 0, "detokenize": False}}
        req = urllib.request.Request(base + "/inference/v1/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"]  # 2 busy cores: can be slow

    try:
        wait_for(healthy, 400, "the vLLM server's /health")
        wait_for(lambda: [x["value"][1] for x in query(prom_port, 'count(up{job="vllm"} == 1)')] == ["1"], 60,
                 "the vLLM server up in the scrape job vllm")
        jobs = {(x["metric"]["job"], x["metric"]["daemon"]) for x in query(prom_port, "up")}
        assert jobs == {("offpolicy", "learner"), ("offpolicy", "rollout-0"), ("vllm", "vllm-0")}
        missing = [grafana_query(e) for e in vllm_exprs()]
        assert len(missing) >= 10
        deadline = time.monotonic() + 180
        for i in range(1000):  # a request every second until every panel's query has data (at most 180 s)
            generate(i)
            missing = [q for q in missing if not query(prom_port, q)]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not missing, f"no data in Prometheus for: {missing}"
        # while it serves (its shutdown on SIGTERM logs errors of its own: EngineDeadError from the output handler)
        assert " ERROR " not in logs["vllm"].read_text(), logs["vllm"].read_text()[-3000:]
    finally:
        stop_all(procs)
