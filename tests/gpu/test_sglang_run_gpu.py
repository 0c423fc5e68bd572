"""`offpolicy run` launches a real SGLang server (rollout.sglang.mode http with no urls) beside the learner on one GPU
and trains through it, with weight updates in flight by rollout.sglang.inflight_switch=abort_all: the run finishes,
nothing lost or trained twice, every token within the staleness bound, every version's load proven. Needs sglang and
a CUDA GPU (skipped otherwise): `PYTHONPATH=/tmp/site:/tmp/ssite python3 -m pytest -s tests/gpu/test_sglang_run_gpu.py`
after `bash deploy/gpu/server.sh sglang install` (offpolicy installed: the run's daemons import offpolicy.services)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import free_ports, sglang_port
from tests.integration.helpers import check_run_invariants, read_jsonl
from tests.vllm_servers import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
              pytest.mark.timeout(900)]

STEPS = 40


def test_offpolicy_run_launches_an_sglang_server_and_trains_through_it_with_switches_in_flight(tmp_path, shm_root):
    work, announce = free_ports(2)
    port = sglang_port()
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", str(ROOT / "configs" / "quickstart-vllm.yaml"),
           f"run.dir={tmp_path / 'runs'}", f"weights.root={shm_root}", f"transport.work_port={work}",
           f"transport.announce_port={announce}", "run.rollouts=1", f"learner.total_steps={STEPS}",
           "learner.device=cuda", "rollout.device=cuda", "model.arch.hidden_size=128",
           "model.arch.max_position_embeddings=512", "rollout.max_new_tokens=256", "model.dtype=bfloat16",
           "rollout.engine=sglang", "rollout.sglang.mode=http", f"rollout.sglang.server_port={port}",
           "rollout.sglang.mem_fraction_static=0.3", "rollout.sglang.attention_backend=triton",
           "rollout.sglang.extra={disable_cuda_graph: true}", "rollout.sglang.startup_timeout_s=600",
           "rollout.inflight_updates=true", "rollout.sglang.inflight_switch=abort_all"]
    out = tmp_path / "launcher.out"
    with open(out, "w") as f:
        # from tmp_path: `-m` puts the working directory first on sys.path, and the checkout's offpolicy/ has no
        # offpolicy.services (pyproject's package-dir maps it from services/ in an installed or editable offpolicy)
        code = subprocess.run(cmd, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, timeout=840).returncode
    text = out.read_text()
    run_dir = tmp_path / "runs" / "quickstart-vllm"
    server_log = run_dir / "logs" / "sglang-0.log"
    assert code == 0, text[-4000:] + (server_log.read_text(errors="replace")[-4000:] if server_log.exists() else "")
    assert "+ 1 SGLang servers" in text
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == STEPS
    rollout = (run_dir / "logs" / "rollout-0.log").read_text()
    switched = rollout.count("switched in flight to weight version")
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    print(f"offpolicy run with a launched SGLang server: {STEPS} steps, {switched} switches in flight (update with "
          f"abort_all_requests), reward {summary['initial_reward_mean']:.3f} -> {summary['final_reward_mean']:.3f}, "
          f"launcher wall {summary['launcher_wall_seconds']} s, last step {json.dumps(last)[:300]}")
    said = [line for line in rollout.splitlines() if re.search(r"weight version \d+ on http", line)]
    assert len(said) >= STEPS // 2 and not [line for line in said if "not proven" in line], said[:5]
