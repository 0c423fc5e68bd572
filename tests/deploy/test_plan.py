"""deploy/slurm/plan.py (the layout of a job) and task.sh (each task's GPUs, index and port), without Slurm."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

from offpolicy.config import load_config
from tests.conftest import QUICKSTART, ROOT
from tests.deploy.conftest import DEPLOY

_spec = importlib.util.spec_from_file_location("offpolicy_deploy_plan", DEPLOY / "slurm" / "plan.py")
plan = sys.modules["offpolicy_deploy_plan"] = importlib.util.module_from_spec(_spec)  # deploy/ is no package
_spec.loader.exec_module(plan)
CLUSTER = str(ROOT / "configs" / "cluster.yaml")
NODES = [f"n{i}" for i in range(8)]


def quick(*overrides: str):
    return load_config(QUICKSTART, list(overrides))


def test_one_node_holds_the_learner_and_every_rollout():
    lay = plan.layout(quick(), ["vm"], rollouts_per_node=2)
    assert (lay.learner_nodes, lay.rollout_nodes, lay.colocated, lay.relay) == (["vm"], ["vm"], True, False)
    assert (lay.n_rollouts, lay.gpus_per_server) == (2, 0)


def test_eight_gpu_nodes_split_into_tp4_servers_after_the_learner_nodes():
    cfg = quick("learner.backend=megatron", "learner.megatron.tp=4", "learner.megatron.pp=2")
    lay = plan.layout(cfg, NODES, learner_nodes=4, learner_tasks_per_node=8, gpus_per_node=8, gpus_per_server=4)
    assert lay.learner_nodes == NODES[:4] and lay.rollout_nodes == NODES[4:]
    assert (lay.rollouts_per_node, lay.n_rollouts, lay.relay) == (2, 8, True)
    assert [lay.rollout_node(i) for i in range(8)] == ["n4", "n4", "n5", "n5", "n6", "n6", "n7", "n7"]


def test_sglang_tp_sets_the_gpus_per_server_and_must_agree_with_it():
    cfg = quick("rollout.engine=sglang", "rollout.sglang.tp_size=4", "model.path=/m")
    assert plan.layout(cfg, NODES[:2], gpus_per_node=8).rollouts_per_node == 2
    with pytest.raises(plan.PlanError, match="tp_size x dp_size = 4"):
        plan.layout(cfg, NODES[:2], gpus_per_node=8, gpus_per_server=2)


@pytest.mark.parametrize("kwargs, match", [
    ({"learner_nodes": 8}, "leaves no rollout node"),
    ({"learner_tasks_per_node": 8}, "is one process"),
    ({"gpus_per_node": 8, "gpus_per_server": 3}, "do not split into servers of 3"),
    ({"gpus_per_node": 0, "gpus_per_server": 4}, "do not split"),
    ({"gpus_per_node": 8, "gpus_per_server": 4, "rollouts_per_node": 3}, "hold 1..2 servers"),
    ({"relay": "maybe"}, "use auto, on or off"),
    ({"gpus_per_node": 8, "learner_gpus": 4}, "--learner-gpus is for one-node GPU jobs"),
])
def test_layouts_that_cannot_work_name_the_option_to_change(kwargs, match):
    with pytest.raises(plan.PlanError, match=match):
        plan.layout(quick(), NODES, **kwargs)


def test_one_gpu_node_needs_the_learners_share_and_gives_rollouts_the_rest():
    with pytest.raises(plan.PlanError, match="--learner-gpus"):
        plan.layout(quick(), ["g0"], gpus_per_node=8, gpus_per_server=2)
    lay = plan.layout(quick(), ["g0"], gpus_per_node=8, gpus_per_server=2, learner_gpus=4)
    assert (lay.gpu_offset, lay.rollouts_per_node) == (4, 2)


def test_megatron_learner_ranks_must_fill_its_model_parallel_layout():
    cfg = quick("learner.backend=megatron", "learner.megatron.tp=4", "learner.megatron.pp=2")
    assert plan.layout(cfg, NODES, learner_nodes=4, learner_tasks_per_node=8, gpus_per_node=8).learner_nodes == NODES[:4]
    with pytest.raises(plan.PlanError, match="not a multiple of learner.megatron.tp x pp x cp = 8"):
        plan.layout(cfg, NODES, learner_nodes=1, learner_tasks_per_node=4, gpus_per_node=8)


def test_the_gpt_oss_config_plans_the_seeds_learner_layout():
    """configs/gptoss20b-sglang.yaml with its header's sbatch line: TP1 x EP16 x PP4 fills 8 learner nodes x 8 ranks
    (DP16); 8 more nodes hold 64 SGLang rollouts of one GPU each (the MXFP4 versions load in place only there), rollout
    8k + i on GPU i of rollout node k, metrics ports 9401-9464. --gpus-per-server 4 (the seed's TP4) no longer matches
    the config; fewer learner ranks, or ranks per stage that EP16 does not divide, are refused."""
    path = ROOT / "configs" / "gptoss20b-sglang.yaml"
    cfg = load_config(path, [])
    m = cfg.learner.megatron
    assert (cfg.learner.backend, m.tp, m.ep, m.pp, m.etp) == ("megatron", 1, 16, 4, 1)
    header = "".join(line[1:] for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    words = shlex.split(header.split("sbatch ", 1)[1].split("by hand", 1)[0].replace("\\\n", " "))
    opts = dict(zip(words, words[1:]))
    assert (opts["--learner-nodes"], opts["--learner-tasks-per-node"], opts["--gpus-per-server"]) == ("8", "8", "1")
    nodes = [f"n{i}" for i in range(16)]
    lay = plan.layout(cfg, nodes, learner_nodes=8, learner_tasks_per_node=8, gpus_per_node=8,
                      gpus_per_server=int(opts["--gpus-per-server"]))
    assert (lay.learner_nodes, lay.rollout_nodes, lay.n_rollouts) == (nodes[:8], nodes[8:], 64)
    assert (lay.gpus_per_server, lay.rollouts_per_node) == (1, 8)
    assert [lay.rollout_node(i) for i in (0, 7, 8, 63)] == ["n8", "n8", "n9", "n15"]
    assert plan.layout(cfg, nodes, learner_nodes=8, learner_tasks_per_node=8, gpus_per_node=8) == lay  # the default
    rollouts = [e["targets"][0] for e in plan.targets(cfg, lay, {}, "1") if e["labels"]["role"] == "rollout"]
    assert rollouts == [f"{nodes[8 + i // 8]}:{9401 + i}" for i in range(64)]
    assert cfg.rollout.groups_per_lease * lay.n_rollouts == cfg.learner.batch_groups  # a step's batch, 2 groups each
    with pytest.raises(plan.PlanError, match="--gpus-per-server 4 but rollout.sglang tp_size x dp_size = 1"):
        plan.layout(cfg, nodes, learner_nodes=8, learner_tasks_per_node=8, gpus_per_node=8, gpus_per_server=4)
    with pytest.raises(plan.PlanError, match="32 learner tasks.*ranks per stage is not a multiple of "
                                             "learner.megatron.ep x etp = 16"):
        plan.layout(cfg, nodes, learner_nodes=4, learner_tasks_per_node=8, gpus_per_node=8, gpus_per_server=1)
    with pytest.raises(plan.PlanError, match="not a multiple of learner.megatron.tp x pp x cp = 4"):
        plan.layout(cfg, nodes, learner_nodes=1, learner_tasks_per_node=6, gpus_per_node=8, gpus_per_server=1)


def test_multi_node_jobs_refuse_loopback_sockets_and_warn_about_loopback_metrics():
    lay = plan.layout(quick(), NODES[:2])
    with pytest.raises(plan.PlanError, match="transport.bind_host=0.0.0.0"):
        plan.check_network(quick(), lay)
    assert "metrics.host=0.0.0.0" in plan.check_network(quick("transport.bind_host=0.0.0.0"), lay)[0]
    assert plan.check_network(load_config(CLUSTER), lay) == []


def test_targets_name_every_daemon_with_its_node_address_and_port():
    cfg = quick("relay.metrics_port=9500")
    lay = plan.layout(cfg, ["a", "b", "c"], gpus_per_node=4, gpus_per_server=2)
    entries = plan.targets(cfg, lay, {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}, "77")
    got = [(e["labels"]["daemon"], e["labels"]["node"], e["targets"][0]) for e in entries]
    assert got == [("learner", "a", "10.0.0.1:9400"), ("rollout-0", "b", "10.0.0.2:9401"),
                   ("rollout-1", "b", "10.0.0.2:9402"), ("rollout-2", "c", "10.0.0.3:9403"),
                   ("rollout-3", "c", "10.0.0.3:9404"), ("relay-source", "a", "10.0.0.1:9500"),
                   ("relay-0", "b", "10.0.0.2:9500"), ("relay-1", "c", "10.0.0.3:9500")]
    assert {e["labels"]["run"] for e in entries} == {"quickstart"} and entries[0]["labels"]["slurm_job"] == "77"
    assert plan.targets(quick("metrics.port=0"), lay, {}, "77") == []


def test_a_learner_on_several_nodes_gets_a_relay_source_on_each_and_the_relays_their_addresses(tmp_path):
    cfg = quick("relay.metrics_port=9500", "learner.backend=megatron")
    lay = plan.layout(cfg, ["a", "b", "c"], learner_nodes=2)
    got = [(e["labels"]["daemon"], e["targets"][0]) for e in plan.targets(cfg, lay, {"a": "10.0.0.1", "b": "10.0.0.2"}, "7")
           if e["labels"]["role"] == "relay"]
    assert got == [("relay-source-0", "10.0.0.1:9500"), ("relay-source-1", "10.0.0.2:9500"), ("relay-0", "c:9500")]
    r = run_plan("slurm", "--config", QUICKSTART, f"run.dir={tmp_path / 'runs'}", "transport.bind_host=0.0.0.0",
                 "learner.backend=megatron", "--nodes", "a=10.0.0.1,b=10.0.0.2,c=10.0.0.3", "--job-id", "5",
                 "--learner-nodes", "2")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert env["RELAY"] == "1" and env["RELAY_SOURCES"] == "10.0.0.1,10.0.0.2"
    r = run_plan("slurm", "--config", QUICKSTART, f"run.dir={tmp_path / 'runs2'}", "transport.bind_host=0.0.0.0",
                 "--nodes", "a=10.0.0.1,b=10.0.0.2", "--job-id", "6")
    assert dict(line.split("=", 1) for line in r.stdout.splitlines())["RELAY_SOURCES"] == "''"  # one learner node
    task(tmp_path, "relay", {"SLURM_PROCID": "0"})  # puts the fake offpolicy-relay on PATH
    r = subprocess.run([str(DEPLOY / "slurm" / "task.sh"), "relay-source", "--config", "c.yaml"], capture_output=True,
                       text=True, timeout=30, env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
                                                   "SLURM_PROCID": "1"})
    assert r.stdout.strip() == "CUDA= ARGS=--serve --index 1 --config c.yaml", r.stderr


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "slurm" / "plan.py"), *args], capture_output=True,
                          text=True, timeout=60)


def test_plan_cli_prepares_the_run_and_prints_the_layout_for_bash(tmp_path):
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    (tmp_path / "runs" / "quickstart" / "summary.json").write_text("{}")  # an earlier run: moved aside
    r = run_plan("slurm", "--config", QUICKSTART, f"run.dir={tmp_path / 'runs'}", "--nodes", "vm=127.0.0.1",
                 "--job-id", "5", "--rollouts-per-node", "3")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert env["N_ROLLOUTS"] == "3" and env["LEARNER_ADDR"] == "127.0.0.1" and env["COLOCATED"] == "1"
    run_dir = tmp_path / "runs" / "quickstart"
    assert (run_dir / "logs").is_dir() and not (run_dir / "summary.json").exists()
    assert len(list((tmp_path / "runs").glob("quickstart-*"))) == 1
    targets = json.loads((tmp_path / "runs" / "prometheus-targets" / "quickstart-5.json").read_text())
    assert [t["targets"][0] for t in targets] == [f"127.0.0.1:{9400 + i}" for i in range(4)]


def test_plan_cli_errors_name_the_fix(tmp_path):
    r = run_plan("slurm", "--config", QUICKSTART, f"run.dir={tmp_path}", "--nodes", "vm", "--resume")
    assert r.returncode == 2 and "drop --resume" in r.stderr
    r = run_plan("slurm", "--config", QUICKSTART, "learner.nope=1", "--nodes", "vm")
    assert r.returncode == 2 and "unknown field learner.nope" in r.stderr


def task(tmp_path, role: str, env: dict[str, str]) -> str:
    """Run task.sh with a fake daemon on PATH that prints its arguments and CUDA_VISIBLE_DEVICES."""
    fake = tmp_path / f"offpolicy-{role}"
    fake.write_text('#!/bin/sh\necho "CUDA=$CUDA_VISIBLE_DEVICES ARGS=$*"\n')
    fake.chmod(0o755)
    full = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "OFFPOLICY_SUPERVISE": "0", **env}
    r = subprocess.run([str(DEPLOY / "slurm" / "task.sh"), role, "--config", "c.yaml"], env=full,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_task_gives_each_rollout_server_its_gpus_index_and_metrics_port_and_each_relay_its_place(tmp_path):
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "OFFPOLICY_GPUS_PER_SERVER": "4", "OFFPOLICY_METRICS_PORT": "9400"}
    assert task(tmp_path, "rollout", {**gpus, "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}) == \
        "CUDA=4,5,6,7 ARGS=--index 3 --config c.yaml metrics.port=9404"
    one = {**gpus, "OFFPOLICY_GPUS_PER_SERVER": "1"}  # configs/gptoss20b-sglang.yaml: a daemon per GPU, 8 a node
    assert task(tmp_path, "rollout", {**one, "SLURM_PROCID": "15", "SLURM_LOCALID": "7"}) == \
        "CUDA=7 ARGS=--index 15 --config c.yaml metrics.port=9416"
    shared = {**gpus, "OFFPOLICY_GPUS_PER_SERVER": "2", "OFFPOLICY_GPU_OFFSET": "4", "OFFPOLICY_LEARNER_GPUS": "4"}
    assert task(tmp_path, "rollout", {**shared, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}).startswith("CUDA=6,7 ")
    assert task(tmp_path, "learner", {**shared, "SLURM_PROCID": "0"}) == "CUDA=0,1,2,3 ARGS=--config c.yaml"
    assert task(tmp_path, "rollout", {"SLURM_PROCID": "0", "OFFPOLICY_METRICS_PORT": "0"}) == \
        "CUDA= ARGS=--index 0 --config c.yaml"
    assert task(tmp_path, "relay", {**gpus, "SLURM_PROCID": "2"}) == "CUDA= ARGS=--index 2 --config c.yaml"


def test_task_refuses_a_server_beyond_the_nodes_gpus(tmp_path):
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,1,2,3", "OFFPOLICY_GPUS_PER_SERVER": "4",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    r = subprocess.run([str(DEPLOY / "slurm" / "task.sh"), "rollout"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "needs GPUs 4..7 but this node shows 4" in r.stderr


def test_the_worked_gpt_oss_layout_of_docs_deploy_md_plans_as_it_says():
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = next(b for b in text.split("```bash")[1:] if "--learner-nodes 8" in b).split("```")[0]
    words = shlex.split(block.replace("\\\n", " "))
    script = words[words.index("deploy/slurm/offpolicy.sbatch") + 1:]
    opts = dict(zip(script[0:-1:2], script[1::2]))
    overrides = [w for w in script if "=" in w and not w.startswith("-")]
    cfg = load_config(ROOT / opts["--config"], overrides)
    assert "--nodes=16" in words and "--gpus-per-node=8" in words
    assert cfg.relay.formats == ["mxfp4"] and cfg.rollout.weights_format == "mxfp4"
    nodes = [f"n{i}" for i in range(16)]
    lay = plan.layout(cfg, nodes, learner_nodes=int(opts["--learner-nodes"]),
                      learner_tasks_per_node=int(opts["--learner-tasks-per-node"]), gpus_per_node=8,
                      gpus_per_server=int(opts["--gpus-per-server"]))
    assert (lay.learner_nodes, lay.rollout_nodes) == (nodes[:8], nodes[8:])
    assert (lay.gpus_per_server, lay.rollouts_per_node, lay.n_rollouts, lay.relay) == (1, 8, 64, True)
    ports = [e["targets"][0].split(":")[1] for e in plan.targets(cfg, lay, {}, "1")]
    assert ports == [str(p) for p in range(9400, 9465)] + ["9500"] * 16  # a source on each learner node, 8 relays
    assert plan.check_network(cfg, lay) == []


def test_the_eval_daemon_is_planned_on_the_learners_node_after_the_rollouts_ports(tmp_path):
    cfg = quick("eval.every_versions=10", "eval.gpus=[7]", "eval.device=cuda")
    lay = plan.layout(cfg, ["a", "b", "c"], gpus_per_node=4, gpus_per_server=2)
    got = [(e["labels"]["daemon"], e["labels"]["role"], e["targets"][0]) for e in plan.targets(cfg, lay, {}, "1")]
    assert got[-1] == ("eval", "eval", "a:9405") and len(got) == 6  # learner, 4 rollouts, eval
    assert plan.eval_plan(cfg, lay) == {"EVAL": 1, "EVAL_GPUS": [7], "EVAL_FINISH_TIMEOUT": 1800,
                                        "EVAL_METRICS_PORT": 9405}
    assert plan.eval_plan(quick(), lay)["EVAL"] == 0 and "eval" not in str(plan.targets(quick(), lay, {}, "1"))
    r = run_plan("slurm", "--config", QUICKSTART, f"run.dir={tmp_path}", "eval.every_versions=5", "--nodes", "vm")
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert (env["EVAL"], env["EVAL_GPUS"], env["EVAL_METRICS_PORT"]) == ("1", "''", "9402")  # 1 CPU rollout


def test_task_runs_the_eval_daemon_on_its_gpus_or_the_cpu(tmp_path):
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "OFFPOLICY_EVAL_METRICS_PORT": "9409"}
    assert task(tmp_path, "eval", {**gpus, "OFFPOLICY_EVAL_GPUS": "6,7"}) == \
        "CUDA=6,7 ARGS=--config c.yaml metrics.port=9409"
    assert task(tmp_path, "eval", {**gpus, "OFFPOLICY_EVAL_METRICS_PORT": "0"}) == "CUDA= ARGS=--config c.yaml"
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,1", "OFFPOLICY_EVAL_GPUS": "3"}
    r = subprocess.run([str(DEPLOY / "slurm" / "task.sh"), "eval"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "eval.gpus names GPU 3 but this node shows 2" in r.stderr


# --- the server step (rollout.engine vllm or sglang, http mode, no urls) ------------------------------------
QUICK_VLLM = str(ROOT / "configs" / "quickstart-vllm.yaml")


def vllm_gpu(*overrides: str):
    return quick("rollout.engine=vllm", "rollout.vllm.mode=http", "rollout.device=cuda",
                 "rollout.vllm.tensor_parallel_size=4", *overrides)


def sglang_gpu(*overrides: str):
    return quick("rollout.engine=sglang", "rollout.sglang.mode=http", "rollout.device=cuda", "rollout.sglang.tp_size=4",
                 *overrides)


def test_the_servers_parallel_sizes_set_the_gpus_per_server_and_must_agree_with_it():
    lay = plan.layout(vllm_gpu(), NODES[:3], gpus_per_node=8)
    assert (lay.gpus_per_server, lay.rollouts_per_node, lay.n_rollouts) == (4, 2, 4)
    assert plan.layout(vllm_gpu("rollout.vllm.data_parallel_size=2"), NODES[:2], gpus_per_node=8).gpus_per_server == 8
    with pytest.raises(plan.PlanError, match="rollout.vllm tensor_parallel_size x data_parallel_size = 4"):
        plan.layout(vllm_gpu(), NODES[:2], gpus_per_node=8, gpus_per_server=2)
    cpu = load_config(QUICK_VLLM, [])  # vLLM on the CPU: no GPUs per server
    assert plan.layout(cpu, ["vm"], rollouts_per_node=2).gpus_per_server == 0
    lay = plan.layout(sglang_gpu("rollout.sglang.dp_size=2"), NODES[:3], gpus_per_node=8)  # SGLang: tp x dp
    assert (lay.gpus_per_server, lay.rollouts_per_node, lay.n_rollouts) == (8, 1, 2)
    with pytest.raises(plan.PlanError, match="rollout.sglang tp_size x dp_size = 4"):
        plan.layout(sglang_gpu(), NODES[:2], gpus_per_node=8, gpus_per_server=2)
    # SGLang servers the user runs (urls): the daemons take a GPU each by default, as before
    assert plan.layout(sglang_gpu("rollout.sglang.urls=[http://h:1]"), NODES[:2], gpus_per_node=8).gpus_per_server == 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_server_step_runs_one_server_per_rollout_with_its_port_and_a_prometheus_target(engine):
    make = vllm_gpu if engine == "vllm" else sglang_gpu
    metrics = ["rollout.sglang.enable_metrics=true"] if engine == "sglang" else []  # else SGLang serves no /metrics
    cfg = make("metrics.host=0.0.0.0", f"rollout.{engine}.server_port=8200", *metrics)
    lay = plan.layout(cfg, ["a", "b"], gpus_per_node=8)
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    assert plan.server_plan(cfg, lay) == {"SERVERS": engine, "SERVER_NAME": name, "SERVER_PORT": 8200,
                                          "SERVER_HOST": "0.0.0.0"}
    got = [(e["labels"]["daemon"], e["labels"]["role"], e["targets"][0])
           for e in plan.targets(cfg, lay, {"a": "10.0.0.1", "b": "10.0.0.2"}, "9")]
    assert got[3:] == [(f"{engine}-0", engine, "10.0.0.2:8200"), (f"{engine}-1", engine, "10.0.0.2:8201")]
    # metrics off: the servers listen on loopback only, and no target is written
    off = make("metrics.port=0")
    assert plan.server_plan(off, lay)["SERVER_HOST"] == "127.0.0.1" and plan.targets(off, lay, {}, "9") == []
    # servers the user runs (urls), or the engine in the daemon: no step
    for other in (make(f"rollout.{engine}.urls=[http://127.0.0.1:9000]"),
                  make(f"rollout.{engine}.mode=engine", "model.path=/m"), quick()):
        assert plan.server_plan(other, lay)["SERVERS"] == "" and engine not in str(plan.targets(other, lay, {}, "9"))


def test_sglang_servers_without_enable_metrics_get_no_prometheus_target():
    cfg = sglang_gpu("metrics.host=0.0.0.0")
    lay = plan.layout(cfg, ["a", "b"], gpus_per_node=8)
    assert plan.server_plan(cfg, lay)["SERVERS"] == "sglang"
    assert [e["labels"]["role"] for e in plan.targets(cfg, lay, {}, "9")] == ["learner", "rollout", "rollout"]


@pytest.mark.parametrize("overrides, match", [
    (["rollout.vllm.server_port=9401"], "overlap metrics.port"),
    (["rollout.vllm.server_port=5555"], "overlap transport.announce_port, transport.work_port"),
    (["rollout.vllm.server_port=65533"], "65533 \\+ 4 servers passes 65535"),
    (["rollout.engine=sglang", "rollout.sglang.mode=http", "rollout.sglang.tp_size=4",
      "rollout.sglang.server_port=9401"],
     "SGLang servers take ports rollout.sglang.server_port 9401..9404, which overlap metrics.port"),
    (["rollout.engine=sglang", "rollout.sglang.mode=http", "rollout.sglang.tp_size=4",
      "rollout.sglang.server_port=55533", "run.rollouts=1"],  # the config's check knows run.rollouts only
     "55533 \\+ 4 servers passes 55535 \\(SGLang takes port \\+ 10000 for gRPC\\)"),
])
def test_server_ports_that_clash_name_the_field_to_move(overrides, match):
    cfg = vllm_gpu(*overrides)
    with pytest.raises(plan.PlanError, match=match):
        plan.server_plan(cfg, plan.layout(cfg, ["a", "b", "c"], gpus_per_node=8))


def test_plan_cli_prints_the_server_step_and_local_targets_list_the_launched_servers(tmp_path):
    r = run_plan("slurm", "--config", QUICK_VLLM, f"run.dir={tmp_path}", "metrics.port=9400", "--nodes", "vm=127.0.0.1",
                 "--rollouts-per-node", "2")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert (env["SERVERS"], env["SERVER_NAME"], env["SERVER_PORT"], env["SERVER_HOST"], env["GPUS_PER_SERVER"]) == \
        ("vllm", "vLLM", "8100", "127.0.0.1", "0")
    out = tmp_path / "local.json"
    r = run_plan("targets", "--config", QUICK_VLLM, "metrics.port=9400", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert [(t["labels"]["daemon"], t["targets"][0]) for t in json.loads(out.read_text())][-2:] == \
        [("vllm-0", "127.0.0.1:8100"), ("vllm-1", "127.0.0.1:8101")]
    r = run_plan("slurm", "--config", QUICKSTART, f"run.dir={tmp_path}", "rollout.engine=sglang",
                 "rollout.sglang.mode=http", "--nodes", "vm")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert (env["SERVERS"], env["SERVER_NAME"], env["SERVER_PORT"]) == ("sglang", "SGLang", "30000")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_task_starts_each_server_on_its_rollouts_gpus_and_points_the_rollout_at_it(tmp_path, engine):
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/sh\nshift\necho "CUDA=$CUDA_VISIBLE_DEVICES ARGS=$*"\n')  # drops server.py's path
    fake.chmod(0o755)
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "OFFPOLICY_GPUS_PER_SERVER": "4",
            "OFFPOLICY_METRICS_PORT": "9400", "OFFPOLICY_SERVERS": engine, "OFFPOLICY_SERVER_PORT": "8100",
            "OFFPOLICY_SERVER_HOST": "0.0.0.0", "OFFPOLICY_PYTHON": str(fake), "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1"}
    assert task(tmp_path, "server", gpus) == "CUDA=4,5,6,7 ARGS=--index 3 --host 0.0.0.0 --config c.yaml"
    assert task(tmp_path, "rollout", gpus) == \
        f"CUDA= ARGS=--index 3 --config c.yaml metrics.port=9404 rollout.{engine}.urls=[http://127.0.0.1:8103]"
    env = {"PATH": os.environ["PATH"], "OFFPOLICY_SERVER_PORT": "8100", "SLURM_PROCID": "0"}
    r = subprocess.run([str(DEPLOY / "slurm" / "task.sh"), "server"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "OFFPOLICY_SERVERS (vllm or sglang) is unset" in r.stderr


def server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "slurm" / "server.py"), *args], capture_output=True,
                          text=True, timeout=120)


def test_the_server_script_runs_the_vllm_server_offpolicy_run_launches_and_builds_the_initial_model_once(tmp_path):
    from offpolicy.rollout.engines.vllm.launch import server_command

    overrides = [f"run.dir={tmp_path}", "rollout.vllm.server_port=8300", "rollout.vllm.tensor_parallel_size=1"]
    r = server("--config", QUICK_VLLM, *overrides, "--index", "2", "--host", "0.0.0.0", "--print")
    assert r.returncode == 0, r.stderr
    model = tmp_path / "quickstart-vllm" / "vllm-initial-model"
    assert (model / "config.json").exists() and list(model.glob("*.safetensors"))
    words = shlex.split(r.stdout)
    assert words == server_command(load_config(QUICK_VLLM, overrides), str(model), 2, True, host="0.0.0.0")
    assert words[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enable-scale-out" in words
    flags = dict(zip(words, words[1:]))
    assert (flags["--port"], flags["--host"], flags["--seed"], flags["--max-model-len"]) == ("8302", "0.0.0.0", "2", "64")
    assert flags["--worker-extension-cls"] == "offpolicy.rollout.engines.vllm.worker.Extension"


def test_the_server_script_runs_the_sglang_server_offpolicy_run_launches(tmp_path):
    from offpolicy.rollout.engines.sglang.launch import server_command

    overrides = [f"run.dir={tmp_path}", "rollout.engine=sglang", "rollout.sglang.mode=http",
                 "rollout.sglang.server_port=31000", "rollout.sglang.enable_metrics=true"]
    r = server("--config", QUICKSTART, *overrides, "--index", "1", "--print")
    assert r.returncode == 0, r.stderr
    model = tmp_path / "quickstart" / "sglang-initial-model"
    assert (model / "config.json").exists() and list(model.glob("*.safetensors"))
    words = shlex.split(r.stdout)
    assert words == server_command(load_config(QUICKSTART, overrides), str(model), 1)
    assert words[1:3] == ["-m", "sglang.launch_server"] and "--enable-metrics" in words
    flags = dict(zip(words, words[1:]))
    assert (flags["--port"], flags["--host"], flags["--random-seed"]) == ("31001", "127.0.0.1", "1")
    # SGLang not installed here: refused before anything starts, unless rollout.sglang.launch runs it
    if importlib.util.find_spec("sglang") is None:
        r = server("--config", QUICKSTART, *overrides, "--index", "1")
        assert r.returncode == 2 and "SGLang is not installed" in r.stderr and "rollout.sglang.launch" in r.stderr


def test_the_server_script_refuses_a_config_without_servers_naming_the_field():
    r = server("--config", QUICKSTART, "--index", "0")
    assert r.returncode == 2 and "rollout.engine=vllm or sglang with rollout.<engine>.mode=http" in r.stderr
    r = server("--config", QUICK_VLLM, "rollout.vllm.mode=engine", "--index", "0")
    assert r.returncode == 2 and "(rollout.vllm.mode engine)" in r.stderr
    r = server("--config", QUICK_VLLM, "rollout.vllm.server_port=65000", "--index", "600")
    assert r.returncode == 2 and "port rollout.vllm.server_port + index is not a TCP port" in r.stderr
