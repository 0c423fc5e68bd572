"""deploy/slurm/plan.py (the layout of a job) and task.sh (each task's GPUs, index and port), without Slurm."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

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


def test_sglang_servers_the_job_would_have_to_launch_are_refused_naming_the_field():
    with pytest.raises(plan.PlanError, match=r"rollout\.sglang\.urls is empty .* starts no SGLang servers"):
        plan.layout(quick("rollout.engine=sglang", "rollout.sglang.mode=http"), NODES)


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


# --- the vLLM server step (rollout.engine vllm, http mode, no urls) ------------------------------------
QUICK_VLLM = str(ROOT / "configs" / "quickstart-vllm.yaml")


def vllm_gpu(*overrides: str):
    return quick("rollout.engine=vllm", "rollout.vllm.mode=http", "rollout.device=cuda",
                 "rollout.vllm.tensor_parallel_size=4", *overrides)


def test_vllm_tensor_parallel_size_sets_the_gpus_per_server_and_must_agree_with_it():
    lay = plan.layout(vllm_gpu(), NODES[:3], gpus_per_node=8)
    assert (lay.gpus_per_server, lay.rollouts_per_node, lay.n_rollouts) == (4, 2, 4)
    assert plan.layout(vllm_gpu("rollout.vllm.data_parallel_size=2"), NODES[:2], gpus_per_node=8).gpus_per_server == 8
    with pytest.raises(plan.PlanError, match="rollout.vllm tensor_parallel_size x data_parallel_size = 4"):
        plan.layout(vllm_gpu(), NODES[:2], gpus_per_node=8, gpus_per_server=2)
    cpu = load_config(QUICK_VLLM, [])  # vLLM on the CPU: no GPUs per server
    assert plan.layout(cpu, ["vm"], rollouts_per_node=2).gpus_per_server == 0


def test_the_vllm_step_runs_one_server_per_rollout_with_its_port_and_a_prometheus_target():
    cfg = vllm_gpu("metrics.host=0.0.0.0", "rollout.vllm.server_port=8200")
    lay = plan.layout(cfg, ["a", "b"], gpus_per_node=8)
    assert plan.vllm_plan(cfg, lay) == {"VLLM": 1, "VLLM_PORT": 8200, "VLLM_HOST": "0.0.0.0"}
    got = [(e["labels"]["daemon"], e["labels"]["role"], e["targets"][0])
           for e in plan.targets(cfg, lay, {"a": "10.0.0.1", "b": "10.0.0.2"}, "9")]
    assert got[3:] == [("vllm-0", "vllm", "10.0.0.2:8200"), ("vllm-1", "vllm", "10.0.0.2:8201")]
    # metrics off: the servers listen on loopback only, and no target is written
    off = vllm_gpu("metrics.port=0")
    assert plan.vllm_plan(off, lay)["VLLM_HOST"] == "127.0.0.1" and plan.targets(off, lay, {}, "9") == []
    # servers the user runs (urls), or vLLM in the daemon: no step
    for other in (vllm_gpu("rollout.vllm.urls=[http://127.0.0.1:9000]"), vllm_gpu("rollout.vllm.mode=engine"), quick()):
        assert plan.vllm_plan(other, lay)["VLLM"] == 0 and "vllm" not in str(plan.targets(other, lay, {}, "9"))


@pytest.mark.parametrize("overrides, match", [
    (["rollout.vllm.server_port=9401"], "overlap metrics.port"),
    (["rollout.vllm.server_port=5555"], "overlap transport.announce_port, transport.work_port"),
    (["rollout.vllm.server_port=65533"], "65533 \\+ 4 servers passes 65535"),
])
def test_vllm_server_ports_that_clash_name_the_field_to_move(overrides, match):
    cfg = vllm_gpu(*overrides)
    with pytest.raises(plan.PlanError, match=match):
        plan.vllm_plan(cfg, plan.layout(cfg, ["a", "b", "c"], gpus_per_node=8))


def test_plan_cli_prints_the_vllm_step_and_local_targets_list_the_launched_servers(tmp_path):
    r = run_plan("slurm", "--config", QUICK_VLLM, f"run.dir={tmp_path}", "metrics.port=9400", "--nodes", "vm=127.0.0.1",
                 "--rollouts-per-node", "2")
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert (env["VLLM"], env["VLLM_PORT"], env["VLLM_HOST"], env["GPUS_PER_SERVER"]) == ("1", "8100", "127.0.0.1", "0")
    out = tmp_path / "local.json"
    r = run_plan("targets", "--config", QUICK_VLLM, "metrics.port=9400", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert [(t["labels"]["daemon"], t["targets"][0]) for t in json.loads(out.read_text())][-2:] == \
        [("vllm-0", "127.0.0.1:8100"), ("vllm-1", "127.0.0.1:8101")]


def test_task_starts_each_vllm_server_on_its_rollouts_gpus_and_points_the_rollout_at_it(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/sh\nshift\necho "CUDA=$CUDA_VISIBLE_DEVICES ARGS=$*"\n')  # drops vllm_server.py's path
    fake.chmod(0o755)
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "OFFPOLICY_GPUS_PER_SERVER": "4", "OFFPOLICY_METRICS_PORT": "9400",
            "OFFPOLICY_VLLM_PORT": "8100", "OFFPOLICY_VLLM_HOST": "0.0.0.0", "OFFPOLICY_PYTHON": str(fake),
            "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}
    assert task(tmp_path, "vllm", gpus) == "CUDA=4,5,6,7 ARGS=--index 3 --host 0.0.0.0 --config c.yaml"
    assert task(tmp_path, "rollout", gpus) == \
        "CUDA= ARGS=--index 3 --config c.yaml metrics.port=9404 rollout.vllm.urls=[http://127.0.0.1:8103]"


def vllm_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "slurm" / "vllm_server.py"), *args], capture_output=True,
                          text=True, timeout=120)


def test_vllm_server_runs_the_command_offpolicy_run_launches_and_builds_the_initial_model_once(tmp_path):
    from offpolicy.rollout.engines.vllm.launch import server_command

    overrides = [f"run.dir={tmp_path}", "rollout.vllm.server_port=8300", "rollout.vllm.tensor_parallel_size=1"]
    r = vllm_server("--config", QUICK_VLLM, *overrides, "--index", "2", "--host", "0.0.0.0", "--print")
    assert r.returncode == 0, r.stderr
    model = tmp_path / "quickstart-vllm" / "vllm-initial-model"
    assert (model / "config.json").exists() and list(model.glob("*.safetensors"))
    words = shlex.split(r.stdout)
    assert words == server_command(load_config(QUICK_VLLM, overrides), str(model), 2, True, host="0.0.0.0")
    assert words[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enable-scale-out" in words
    flags = dict(zip(words, words[1:]))
    assert (flags["--port"], flags["--host"], flags["--seed"], flags["--max-model-len"]) == ("8302", "0.0.0.0", "2", "64")
    assert flags["--worker-extension-cls"] == "offpolicy.rollout.engines.vllm.worker.Extension"


def test_vllm_server_refuses_a_config_without_vllm_servers_naming_the_field():
    r = vllm_server("--config", QUICKSTART, "--index", "0")
    assert r.returncode == 2 and "rollout.engine=vllm and rollout.vllm.mode=http" in r.stderr
    r = vllm_server("--config", QUICK_VLLM, "rollout.vllm.mode=engine", "--index", "0")
    assert r.returncode == 2 and "rollout.vllm.mode=http" in r.stderr


def test_the_gpt_oss_vllm_config_plans_tp4_vllm_servers_beside_the_seeds_learner_layout():
    """configs/gptoss20b-vllm.yaml with its header's sbatch line: 8 learner nodes (TP1 x EP16 x PP4), 8 rollout
    nodes with two TP4 vLLM servers each (the vllm step, ports 8100 + i on 0.0.0.0), every server a target."""
    from offpolicy.rollout.engines.vllm.launch import server_command

    text = (ROOT / "docs" / "deploy.md").read_text()  # its worked layout in docs/deploy.md
    block = next(b for b in (c.split("```")[0] for c in text.split("```bash")[1:]) if "gptoss20b-vllm.yaml" in b)
    words = shlex.split(block.replace("\\\n", " "))
    script = words[words.index("deploy/slurm/offpolicy.sbatch") + 1:]
    opts = dict(zip(script[0:-1:2], script[1::2]))
    assert "--nodes=16" in words and "--gpus-per-node=8" in words and "--gpus-per-server" not in opts
    cfg = load_config(ROOT / opts["--config"], [w for w in script if "=" in w and not w.startswith("-")])
    nodes = [f"n{i}" for i in range(16)]
    lay = plan.layout(cfg, nodes, learner_nodes=int(opts["--learner-nodes"]),
                      learner_tasks_per_node=int(opts["--learner-tasks-per-node"]), gpus_per_node=8)
    assert (lay.rollout_nodes, lay.gpus_per_server, lay.rollouts_per_node, lay.n_rollouts) == (nodes[8:], 4, 2, 16)
    assert plan.vllm_plan(cfg, lay) == {"VLLM": 1, "VLLM_PORT": 8100, "VLLM_HOST": "0.0.0.0"}
    vllm = [(e["labels"]["node"], e["targets"][0]) for e in plan.targets(cfg, lay, {}, "1") if e["labels"]["role"] == "vllm"]
    assert vllm == [(nodes[8 + i // 2], f"{nodes[8 + i // 2]}:{8100 + i}") for i in range(16)]
    assert plan.check_network(cfg, lay) == []
    words = server_command(cfg, cfg.model.path, 3, on_cpu=False, host="0.0.0.0")
    flags = dict(zip(words, words[1:]))
    assert (flags["--tensor-parallel-size"], flags["--port"], flags["--max-num-seqs"]) == ("4", "8103", "512")
    assert "--enable-expert-parallel" in words and "--kv-cache-memory-bytes" not in words
    # what the vllm step runs (rollout.device cuda: the GPU flags even where this test has no GPU)
    r = vllm_server("--config", str(ROOT / "configs" / "gptoss20b-vllm.yaml"), "--index", "3", "--host", "0.0.0.0",
                    "--print")
    assert r.returncode == 0 and shlex.split(r.stdout) == words, r.stderr


def test_task_restarts_a_dead_rollout_daemon_within_the_budget_and_ends_with_its_goodbye(tmp_path):
    """Slurm restarts nothing in a job: task.sh runs the rollout daemon under offpolicy-supervise, which restarts
    it (here: killed by SIGKILL twice, then it leaves with 0 as on the learner's Goodbye) and then ends with 0;
    past run.supervise.max_restarts the task ends with the daemon's status, saying why."""
    fake = tmp_path / "offpolicy-rollout"
    fake.write_text('#!/bin/sh\nn=$(cat "$COUNT" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNT"\n'
                    'echo "start $((n + 1)) ARGS=$*"\n[ "$n" -lt "$DIES" ] && kill -9 $$\nexit 0\n')
    fake.chmod(0o755)
    path = os.pathsep.join([str(tmp_path), str(Path(sys.executable).parent), os.environ["PATH"]])

    def run(dies: int, *overrides: str) -> subprocess.CompletedProcess:
        (tmp_path / "count").unlink(missing_ok=True)
        env = {"PATH": path, "SLURM_PROCID": "2", "COUNT": str(tmp_path / "count"), "DIES": str(dies)}
        return subprocess.run([str(DEPLOY / "slurm" / "task.sh"), "rollout", "--config", QUICKSTART,
                               "run.supervise.backoff_s=0.1", *overrides], env=env, capture_output=True, text=True,
                              timeout=60)

    r = run(2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("start 3 ARGS=--index 2 --config")
    assert r.stderr.count("rollout-2 (pid") == 2 and "was killed by SIGKILL" in r.stderr
    assert "restarting it in 0 s (restart 2 of run.supervise.max_restarts=3)" in r.stderr
    r = run(5, "run.supervise.max_restarts=1")
    assert r.returncode == 128 + 9 and len(r.stdout.splitlines()) == 2
    assert "its restart budget is spent: 1 restart(s)" in r.stderr and "not restarted" in r.stderr
