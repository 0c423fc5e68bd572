"""`offpolicy run`: the launcher starts real daemons on loopback and the run obeys its invariants."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import QUICKSTART
from tests.integration.helpers import check_run_invariants, read_jsonl


def offpolicy_run(overrides, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *overrides, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("staleness", [0, 1])
def test_short_run_obeys_staleness_and_exactly_once(run_overrides, staleness):
    res = offpolicy_run(run_overrides, "learner.total_steps=25", f"algo.max_staleness={staleness}")
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, staleness)
    assert summary["steps"] == 25
    assert summary["max_staleness_seen"] == staleness  # s=1 overlaps: some batch is one version old
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert (run_dir / "logs" / "learner.log").exists() and (run_dir / "logs" / "rollout-1.log").exists()
    assert "prompts_lost" in res.stdout


def test_quickstart_learns(run_overrides):
    """The README's quickstart claim: from near chance to >= 0.8 reward, nothing lost or duplicated."""
    res = offpolicy_run(run_overrides, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)
    assert summary["initial_reward_mean"] < 0.15
    assert summary["final_reward_mean"] >= 0.8
    rewards = [r["reward_mean"] for r in read_jsonl(run_overrides.run_dir / "quickstart" / "metrics.jsonl")]
    assert max(rewards[-20:]) > min(rewards[:20]) + 0.5


def test_bad_override_names_the_field(run_overrides):
    res = offpolicy_run(run_overrides, "algo.max_stalenes=1", timeout=30)
    assert res.returncode == 2
    assert "algo.max_stalenes" in res.stderr and "max_staleness" in res.stderr


def test_busy_port_is_reported(run_overrides):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", run_overrides.work_port))
        s.listen()
        res = offpolicy_run(run_overrides, timeout=30)
    assert res.returncode == 2
    assert f"transport.work_port={run_overrides.work_port}" in res.stderr


def test_resume_extends_a_finished_run(run_overrides):
    assert offpolicy_run(run_overrides, "learner.total_steps=8").returncode == 0
    res = offpolicy_run(run_overrides, "--resume", "learner.total_steps=12")
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == 12
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000008", "step-000012"]
    # each checkpoint carries its HF export: transformers loads it, equal to the backend's own weights
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    last = run_dir / "checkpoints" / "step-000012"
    model = AutoModelForCausalLM.from_pretrained(last / "hf")
    own = load_file(str(last / "backend" / "model.safetensors"))
    for name, t in model.state_dict().items():
        if name in own:
            assert torch.equal(t, own[name].to(t.dtype)), name
    assert "resuming at step 8" in (run_dir / "logs" / "learner.log").read_text()
