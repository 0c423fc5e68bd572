"""deploy/slurm/offpolicy.sbatch on a real Slurm (Debian's slurm-wlm, two slurmd on this machine): the
quickstart with one learner task and two rollout tasks on one node learns; a job cancelled with `scancel`
checkpoints and writes its summary; `--resume` continues it, and SIGTERM to the batch script (the
time-limit signal) stops it cleanly; a two-node job puts the learner on one node and the rollouts on
the other, and when every rollout dies the learner is stopped with a checkpoint and the job fails; a vLLM
job runs its vLLM server as a step beside the rollout and stops it at the end, and an SGLang job its SGLang
servers (the stand-in server)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, ROOT, free_ports
from tests.deploy.conftest import DEPLOY, port_block
from tests.integration.helpers import check_run_invariants, read_jsonl, wait_for

pytestmark = pytest.mark.slow
SBATCH = DEPLOY / "slurm" / "offpolicy.sbatch"
QUICKSTART_VLLM = ROOT / "configs" / "quickstart-vllm.yaml"
DONE = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def job_info(slurm, job: str) -> dict[str, str]:
    out = slurm.run("scontrol", "show", "job", "-o", job)
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_job(slurm, job: str, timeout: float, out: Path) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(slurm, job)
        if info["JobState"] in DONE:
            return info
        time.sleep(1)
    slurm.run("scancel", job)
    raise AssertionError(f"job {job} still {info['JobState']} after {timeout}s; batch output:\n"
                         f"{read(out)}\n{slurm.logs()}")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} does not exist)"


@pytest.fixture
def job(slurm, tmp_path, shm_root):
    """Submit offpolicy.sbatch with the quickstart on private ports and directories."""
    work, announce = free_ports(2)
    metrics = port_block(3)
    run_dir = tmp_path / "runs" / "quickstart"
    overrides = [f"run.dir={tmp_path / 'runs'}", f"weights.root={shm_root}", f"transport.work_port={work}",
                 f"transport.announce_port={announce}", f"metrics.port={metrics}"]

    def submit(*extra: str, nodes: int = 1) -> tuple[str, Path]:
        out = slurm.run("sbatch", "--parsable", f"--nodes={nodes}", f"--output={tmp_path}/slurm-%j.out", str(SBATCH),
                        "--config", QUICKSTART, "--rollouts-per-node", "2", *overrides, *extra)
        job_id = out.strip().split(";")[0]
        return job_id, tmp_path / f"slurm-{job_id}.out"

    submit.run_dir, submit.metrics_port, submit.targets = run_dir, metrics, tmp_path / "runs" / "prometheus-targets"
    return submit


def test_quickstart_job_completes_learns_and_leaves_a_log_per_daemon(slurm, job):
    job_id, out = job("learner.total_steps=150")
    info = wait_job(slurm, job_id, 300, out)
    batch = read(out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info['JobState']}\n{batch}"
    summary = check_run_invariants(job.run_dir, max_staleness=1)
    assert summary["steps"] == 150
    assert summary["final_reward_mean"] > summary["initial_reward_mean"] + 0.3, summary
    logs = job.run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["learner-0.log", "rollout-0.log", "rollout-1.log"]
    assert "done:" in read(logs / "learner-0.log")
    for i in (0, 1):
        assert f"joined run quickstart as rollout-{i}@" in read(logs / f"rollout-{i}.log")
    assert "learner on" in batch and "2 rollout(s)" in batch
    assert not list(job.targets.glob("*.json")), "the Prometheus target file outlived the job"


def test_scancel_checkpoints_and_resume_continues(slurm, job):
    job_id, out = job("learner.total_steps=5000")
    metrics = job.run_dir / "metrics.jsonl"
    wait_for(lambda: job_info(slurm, job_id)["JobState"] in DONE or
             metrics.exists() and len(metrics.read_text().splitlines()) >= 20, 180, "20 training steps")
    assert job_info(slurm, job_id)["JobState"] == "RUNNING", read(out)

    # While it runs, the job's Prometheus target list names every daemon, and they answer.
    targets = json.loads((job.targets / f"quickstart-{job_id}.json").read_text())
    assert [t["labels"]["daemon"] for t in targets] == ["learner", "rollout-0", "rollout-1"]
    assert [t["targets"][0].rsplit(":", 1)[1] for t in targets] == [str(job.metrics_port + i) for i in range(3)]
    for t in targets:
        text = urllib.request.urlopen(f"http://{t['targets'][0]}/metrics", timeout=5).read().decode()
        assert "offpolicy_" in text

    slurm.run("scancel", job_id)
    info = wait_job(slurm, job_id, 120, out)
    assert info["JobState"] == "CANCELLED"
    summary = json.loads((job.run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert 20 <= steps < 5000
    assert (job.run_dir / "checkpoints" / f"step-{steps:06d}").is_dir(), read(job.run_dir / "logs" / "learner-0.log")
    assert not list(job.targets.glob("*.json")), "the Prometheus target file outlived the cancelled job"

    # --resume continues it; stopped the way Slurm does near the time limit (#SBATCH --signal=B:TERM@120):
    # SIGTERM to the batch script only, which passes it to the learner step; the job then ends normally.
    job_id, out = job("--resume", f"learner.total_steps={steps + 1000}")
    wait_for(lambda: job_info(slurm, job_id)["JobState"] in DONE or
             len(metrics.read_text().splitlines()) >= steps + 10, 180, "10 more training steps")
    slurm.run("scancel", "--batch", "--signal=TERM", job_id)
    info = wait_job(slurm, job_id, 180, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", read(out)
    assert "got SIGTERM: SIGTERM to the learner" in read(out)
    summary = check_run_invariants(job.run_dir, max_staleness=1)
    resumed = summary["steps"]
    assert steps + 10 <= resumed < steps + 1000
    assert (job.run_dir / "checkpoints" / f"step-{resumed:06d}").is_dir()
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(resumed))
    learner_log = read(job.run_dir / "logs" / "learner-0.log")
    assert learner_log.count("done:") == 2, "the resumed job's log should follow the first one's"


def test_two_nodes_split_into_a_learner_node_and_a_rollout_node_and_dead_rollouts_stop_the_learner(slurm, job):
    # The two "nodes" share this machine's /dev/shm, as nodes share a weights.root on a shared file
    # system: no relay (relays need a /dev/shm per node; tests/integration/test_relay.py covers them).
    job_id, out = job("--relay", "off", "transport.bind_host=0.0.0.0", "metrics.host=0.0.0.0",
                      "learner.total_steps=5000", nodes=2)
    metrics = job.run_dir / "metrics.jsonl"
    wait_for(lambda: job_info(slurm, job_id)["JobState"] in DONE or
             metrics.exists() and len(metrics.read_text().splitlines()) >= 10, 180, "10 training steps")
    first, second = slurm.run("scontrol", "show", "hostnames", job_info(slurm, job_id)["NodeList"]).split()
    logs = job.run_dir / "logs"
    assert f"learner rank 0 on {first}," in read(logs / "learner-0.log")
    for i in (0, 1):
        assert f"rollout {i} on {second}," in read(logs / f"rollout-{i}.log")

    steps = slurm.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j").split()
    slurm.run("scancel", "--signal=KILL", steps[steps.index("rollout") - 1])  # every rollout dies at once
    info = wait_job(slurm, job_id, 180, out)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", read(out)
    assert "every rollout daemon has exited" in read(out)
    summary = check_run_invariants(job.run_dir, max_staleness=1)
    assert (job.run_dir / "checkpoints" / f"step-{summary['steps']:06d}").is_dir()


def test_the_eval_daemon_runs_as_a_step_on_the_learners_node_and_reports_every_asked_version(slurm, job):
    job_id, out = job("learner.total_steps=40", "eval.every_versions=10", "eval.n_samples=4", "eval.k=[1, 4]",
                      "eval.data.synthetic={task: copy, length: 4, num_prompts: 16, seed: 1}")
    info = wait_job(slurm, job_id, 300, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info['JobState']}\n{read(out)}"
    assert check_run_invariants(job.run_dir, max_staleness=1)["steps"] == 40
    rows = read_jsonl(job.run_dir / "eval.jsonl")
    assert [r["version"] for r in rows] == [0, 10, 20, 30, 40] and all("pass_at_k" in r for r in rows)
    log = read(job.run_dir / "logs" / "eval.log")
    assert "task.sh: eval on" in log and "CUDA_VISIBLE_DEVICES=" in log and "version 40: pass@1" in log
    assert (job.run_dir / "eval.png").exists()


@pytest.mark.timeout(1200)  # vLLM starts in 0.5-5 min on 2 busy cores
def test_a_vllm_job_runs_a_vllm_server_step_beside_its_rollout_and_stops_it_after_the_run(slurm, tmp_path, shm_root):
    """configs/quickstart-vllm.yaml as a one-node job: the `vllm` step runs deploy/slurm/server.py (the
    server `offpolicy run` launches), the rollout daemon drives it over HTTP, Prometheus' target list names it
    and its /metrics serves vLLM's metrics; when the learner is done the script stops the server."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: bash deploy/vllm/install-cpu.sh (docs/vllm.md)")
    work, announce = free_ports(2)
    metrics = port_block(4)  # the plan keeps metrics.port .. + rollouts + 1 for the daemons: the server's after them
    server = metrics + 3
    run_dir = tmp_path / "runs" / "quickstart-vllm"
    env = {**slurm.env, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cluster = dataclasses.replace(slurm, env=env)
    out = cluster.run("sbatch", "--parsable", "--nodes=1", f"--output={tmp_path}/slurm-%j.out", str(SBATCH),
                      "--config", str(QUICKSTART_VLLM), "--rollouts-per-node", "1", f"run.dir={tmp_path / 'runs'}",
                      f"weights.root={shm_root}", f"transport.work_port={work}", f"transport.announce_port={announce}",
                      f"metrics.port={metrics}", f"rollout.vllm.server_port={server}", "learner.total_steps=30")
    job_id = out.strip().split(";")[0]
    batch = tmp_path / f"slurm-{job_id}.out"
    logs = run_dir / "logs"
    steps = run_dir / "metrics.jsonl"
    wait_for(lambda: job_info(slurm, job_id)["JobState"] in DONE or steps.exists() and steps.read_text().strip(),
             600, "the first training step")
    assert job_info(slurm, job_id)["JobState"] == "RUNNING", read(batch) + read(logs / "vllm-0.log")[-3000:]
    targets = json.loads((tmp_path / "runs" / "prometheus-targets" / f"quickstart-vllm-{job_id}.json").read_text())
    assert [(t["labels"]["daemon"], t["labels"]["role"], t["targets"][0].rsplit(":", 1)[1]) for t in targets] == \
        [("learner", "learner", str(metrics)), ("rollout-0", "rollout", str(metrics + 1)),
         ("vllm-0", "vllm", str(server))]
    text = urllib.request.urlopen(f"http://127.0.0.1:{server}/metrics", timeout=10).read().decode()
    assert "vllm:num_requests_running" in text and "vllm:generation_tokens_total" in text

    info = wait_job(slurm, job_id, 400, out=batch)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", read(batch)
    assert check_run_invariants(run_dir, max_staleness=1)["steps"] == 30
    assert sorted(p.name for p in logs.iterdir()) == ["learner-0.log", "rollout-0.log", "vllm-0.log"]
    server_log = read(logs / "vllm-0.log")
    assert "task.sh: vllm server 0 on" in server_log and "--enable-scale-out" in server_log, server_log[-3000:]
    assert "VLLM_SERVER_DEV_MODE=1 OFFPOLICY_VLLM_CHECKABLE_WEIGHTS=1" in server_log
    assert f"vLLM server http://127.0.0.1:{server} (vLLM " in read(logs / "rollout-0.log")
    assert "stopping the vLLM servers" in read(batch)
    with socket.socket() as s:  # the server is gone with the job
        assert s.connect_ex(("127.0.0.1", server)) != 0


@pytest.mark.timeout(900)
def test_an_sglang_job_runs_an_sglang_server_step_beside_each_rollout_and_stops_it_after_the_run(slurm, tmp_path,
                                                                                                 shm_root):
    """The quickstart with rollout.engine=sglang in http mode and no urls as a one-node job: the `sglang` step runs
    deploy/slurm/server.py, which execs the server `offpolicy run` launches (here the stand-in server,
    tests/sglang_fake_server.py, through rollout.sglang.launch: SGLang does not run on this machine's CPU) from the
    run's sglang-initial-model, one per rollout daemon on its own port; each daemon drives its node's server; when
    the learner is done the script stops the servers."""
    work, announce = free_ports(2)
    metrics = port_block(6)  # the plan keeps metrics.port .. + rollouts + 1 for the daemons: the servers' after them
    server = metrics + 4
    run_dir = tmp_path / "runs" / "quickstart"
    env = {**slurm.env, "PYTHONPATH": str(ROOT), "OFFPOLICY_FAKE_SGLANG_OVERRIDES": "[]"}
    cluster = dataclasses.replace(slurm, env=env)
    out = cluster.run("sbatch", "--parsable", "--nodes=1", f"--output={tmp_path}/slurm-%j.out", str(SBATCH),
                      "--config", QUICKSTART, "--rollouts-per-node", "2", f"run.dir={tmp_path / 'runs'}",
                      f"weights.root={shm_root}", f"transport.work_port={work}", f"transport.announce_port={announce}",
                      f"metrics.port={metrics}", "rollout.engine=sglang", "rollout.sglang.mode=http",
                      f"rollout.sglang.server_port={server}", "rollout.sglang.startup_timeout_s=300",
                      f"rollout.sglang.launch=[{sys.executable}, -m, tests.sglang_fake_server]",
                      "learner.total_steps=30")
    job_id = out.strip().split(";")[0]
    batch = tmp_path / f"slurm-{job_id}.out"
    logs = run_dir / "logs"
    info = wait_job(slurm, job_id, 600, out=batch)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", read(batch) + read(logs / "sglang-0.log")
    assert check_run_invariants(run_dir, max_staleness=1)["steps"] == 30
    assert sorted(p.name for p in logs.iterdir()) == ["learner-0.log", "rollout-0.log", "rollout-1.log",
                                                      "sglang-0.log", "sglang-1.log"]
    assert f"servers: SGLang, one per rollout, ports {server}+i on" in read(batch)
    for i in (0, 1):
        server_log = read(logs / f"sglang-{i}.log")
        assert f"task.sh: sglang server {i} on" in server_log and "server.py: SGLang server" in server_log, server_log
        assert f"at http://127.0.0.1:{server + i}: model {run_dir / 'sglang-initial-model'}, seed {i}" in server_log
        assert f"SGLang server http://127.0.0.1:{server + i} serves" in read(logs / f"rollout-{i}.log")
    assert "stopping the SGLang servers" in read(batch)
    for i in (0, 1):
        with socket.socket() as s:  # the servers are gone with the job
            assert s.connect_ex(("127.0.0.1", server + i)) != 0
