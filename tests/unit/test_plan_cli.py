"""`offpolicy plan` end to end: the CLI plans, writes its table, JSON and plot, validates, calibrates."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def plan(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "plan", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_plan_ranks_layouts_and_writes_table_json_and_plot(tmp_path):
    r = plan("--model", "qwen2.5-0.5b", "--nodes", "2", "--gpus-per-node", "4", "--gpu", "h100", "--batch", "32",
             "--max-new-tokens", "1024", "--lengths", "lognormal:300:0.7", "--steps", "6", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "| 1 | 1 learner + 1 rollout nodes" in r.stdout and "s=1 tokens/s" in r.stdout
    assert "Not measured here, public figures" in r.stdout and "sglang.decode_efficiency" in r.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    fit = [d for d in doc if d["fits"]]
    tps = [d["runs"]["1"]["tokens_per_s"] for d in fit]
    assert fit and tps == sorted(tps, reverse=True)
    assert {"train_s", "publish_s", "relay_s", "load_s"} <= doc[0]["parts"].keys()
    assert (tmp_path / "plan.png").stat().st_size > 10_000 and (tmp_path / "plan.md").exists()


def test_the_printed_sbatch_command_is_a_layout_deploy_slurm_plan_accepts(tmp_path):
    from offpolicy.config import load_config
    from tests.deploy.test_plan import plan as slurm_plan  # deploy/slurm/plan.py (deploy/ is no package)

    r = plan("--model", "qwen2.5-0.5b", "--nodes", "3", "--gpus-per-node", "4", "--batch", "16",
             "--max-new-tokens", "512", "--lengths", "fixed:200", "--steps", "5", "--top", "2")
    assert r.returncode == 0, r.stderr
    words = shlex.split(next(line for line in r.stdout.splitlines() if line.strip().startswith("sbatch ")))
    opts = dict(zip(words[4::2], words[5::2]))
    overrides = [w for w in words if "=" in w and not w.startswith("-")]
    cfg = load_config(None, [*overrides, "rollout.engine=sglang", "model.path=/m"])
    lay = slurm_plan.layout(cfg, ["n0", "n1", "n2"], learner_nodes=int(opts["--learner-nodes"]),
                            learner_tasks_per_node=int(opts["--learner-tasks-per-node"]), gpus_per_node=4,
                            gpus_per_server=int(opts["--gpus-per-server"]))
    assert len(lay.learner_nodes) + len(lay.rollout_nodes) == 3


def test_a_given_layout_is_evaluated_and_an_oom_is_flagged():
    r = plan("--model", "gpt-oss-20b", "--nodes", "2", "--gpu", "h100", "--steps", "5", "--batch", "16",
             "--layout", "learner_nodes=1,tp=1,ep=1,pp=1,max_tokens=16384,rollout_tp=1,mem_fraction=0.45")
    assert r.returncode == 0, r.stderr
    assert "learner OOM" in r.stdout and "rollout OOM" in r.stdout


def test_errors_name_the_option():
    r = plan("--model", "gpt-oss-21b", "--nodes", "8")
    assert r.returncode == 2 and "not a preset" in r.stderr
    r = plan("--model", "gpt-oss-20b", "--nodes", "8", "--lengths", "gamma:3")
    assert r.returncode == 2 and "--lengths" in r.stderr
    r = plan("--model", "gpt-oss-20b", "--nodes", "8", "--layout", "learner_nodes=2,tpp=2")
    assert r.returncode == 2 and "is not key=value" in r.stderr


def test_validate_prints_measured_and_predicted():
    r = plan("validate")
    assert r.returncode == 0, r.stderr
    assert "2 GPUs: megatron learner + 1 rollout" in r.stdout and "largest error" in r.stdout


def test_calibrate_replaces_entries_from_bench_json(tmp_path):
    rows = [{"bytes": int(gb * 1e9), "publish": [{"mode": "sha256", "mean_seconds": 0.1 + gb / 5}]} for gb in (1, 4)]
    (tmp_path / "weights.json").write_text(json.dumps({"command": "x", "machine": {}, "rows": rows}))
    r = plan("calibrate", str(tmp_path), "--out", str(tmp_path / "cal.yaml"))
    assert r.returncode == 0, r.stderr and "weights.publish.sha256.gbps: 6.565 -> 5" in r.stdout
    r = plan("--model", "qwen2.5-0.5b", "--nodes", "2", "--gpus-per-node", "2", "--steps", "5", "--batch", "8",
             "--max-new-tokens", "256", "--calibration", str(tmp_path / "cal.yaml"), "--top", "1")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow  # the documented plan takes ~20 s
def test_the_gpt_oss_plan_in_docs_deploy_md_is_what_the_planner_prints():
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = next(b for b in text.split("```bash")[1:] if "offpolicy plan --model gpt-oss-20b" in b).split("```")[0]
    words = shlex.split(block.replace("\\\n", " "))
    args = words[words.index("plan") + 1:]
    if "--out" in args:  # the test writes nothing
        i = args.index("--out")
        args = args[:i] + args[i + 2:]
    r = plan(*args, "--top", "1", timeout=300)
    assert r.returncode == 0, r.stderr
    first = next(line for line in r.stdout.splitlines() if line.startswith("| 1 |"))
    layout = first.split("|")[2].strip()
    assert layout in text, f"docs/deploy.md does not show the planner's first layout: {layout}"
