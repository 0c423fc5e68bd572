"""`offpolicy run`: the launcher starts real daemons on loopback and the run obeys its invariants."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import QUICKSTART
from tests.integration.helpers import check_run_invariants, check_timeline, read_jsonl


def offpolicy_run(overrides, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *overrides, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_quickstart_learns_and_a_resume_extends_it(run_overrides):
    """The README's quickstart claim: from near chance to >= 0.8 reward, nothing lost or duplicated, the staleness
    bound held and used (max_staleness_seen 1); then `--resume` extends the finished run, traced (run.trace: every
    process's timeline, merged by `offpolicy trace`). Staleness 0 through this launcher (max_staleness_seen 0, every
    group trained on its own step's version) is test_onpolicy_equivalence.py::test_staleness_zero_equals_synchronous_grpo."""
    res = offpolicy_run(run_overrides, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, 1)
    assert summary["initial_reward_mean"] < 0.15
    assert summary["final_reward_mean"] >= 0.8
    rewards = [r["reward_mean"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert max(rewards[-20:]) > min(rewards[:20]) + 0.5
    steps = summary["steps"]
    assert steps == 300 and summary["max_staleness_seen"] == 1  # s=1 overlaps: some batch is one version old
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert (run_dir / "logs" / "learner.log").exists() and (run_dir / "logs" / "rollout-1.log").exists()
    assert "prompts_lost" in res.stdout

    assert not (run_dir / "trace").exists()
    res = offpolicy_run(run_overrides, f"learner.total_steps={steps + 5}", "run.trace=true", "--resume")
    assert res.returncode == 0, res.stdout + res.stderr
    assert check_run_invariants(run_dir, 1)["steps"] == steps + 5
    assert f"resuming at step {steps}" in (run_dir / "logs" / "learner.log").read_text()
    ckpts = [f"step-{steps:06d}", f"step-{steps + 5:06d}"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ckpts
    # each checkpoint carries its HF export: transformers loads it, equal to the backend's own weights
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    last = run_dir / "checkpoints" / ckpts[-1]
    model = AutoModelForCausalLM.from_pretrained(last / "hf")
    own = load_file(str(last / "backend" / "model.safetensors"))
    for name, t in model.state_dict().items():
        if name in own:
            assert torch.equal(t, own[name].to(t.dtype)), name
    out = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "trace", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    spans = check_timeline(run_dir, range(steps, steps + 5))  # every process's parts, in causal order
    assert sorted(spans) == ["learner", "rollout-0", "rollout-1"]
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == set(spans)
    tracks = sorted(e["args"]["name"] for e in events if e["name"] == "thread_name")
    assert tracks == ["MainThread"] * 3 + ["hub", "publish"]  # no span moved aside: each track's spans nest
    assert {e["name"] for e in events if e["ph"] == "f"} == {"announce", "groups"}  # Perfetto's arrows
    assert (run_dir / "timeline.png").stat().st_size > 10_000 and "learner: " in out.stdout
    assert "announce to load: median" in out.stdout and "send to receive: median" in out.stdout


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


TINY_GPT_OSS = ("model.arch={model_type: gpt_oss, vocab_size: 16, hidden_size: 64, intermediate_size: 64, "
                "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, head_dim: 16, "
                "num_local_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 64, sliding_window: 32, "
                "layer_types: [sliding_attention, full_attention], tie_word_embeddings: false, bos_token_id: 11, "
                "eos_token_id: 13, pad_token_id: 10}")


def test_fp8_rollouts_run_on_the_fp8_versions(run_overrides):
    """Rollouts read weights.formats' fp8 store (dequantized by the torch engine); step 0 trains on version-0
    samples with the learner at version 0, so its logprob mismatch is the fp8 rounding alone: small, not 0.
    weights.native=checkpoints: native versions only where a checkpoint exports one (every 5 steps, the end)."""
    from offpolicy.weights import list_versions
    from offpolicy.weights.store import read_manifest

    res = offpolicy_run(run_overrides, "learner.total_steps=12", "weights.formats=[fp8]",
                        "rollout.weights_format=fp8", "weights.fp8_block_size=[32, 32]", "weights.keep_after_run=true",
                        "weights.native=checkpoints", "checkpoint.every_steps=5")
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    check_run_invariants(run_dir, 1)
    root = next(o.split("=", 1)[1] for o in run_overrides if o.startswith("weights.root="))
    assert list_versions(root, "quickstart/fp8") == [10, 11, 12]
    assert list_versions(root, "quickstart") == [5, 10, 12]
    assert read_manifest(f"{root}/quickstart/fp8/v12").format == "fp8"
    for step in (10, 12):  # checkpoint.keep=2: the newest two, each with the native version as its HF export
        assert read_manifest(run_dir / "checkpoints" / f"step-{step:06d}" / "hf").format == "native"
    first = read_jsonl(run_dir / "metrics.jsonl")[0]
    assert 0 < first["logprob_diff_mean"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [("weights.formats=[fp8]", "rollout.weights_format=fp8"),
                                       (TINY_GPT_OSS, "weights.formats=[mxfp4]", "rollout.weights_format=mxfp4")],
                         ids=["fp8-llama", "mxfp4-gpt-oss"])
def test_quickstart_learns_with_low_bit_rollouts(run_overrides, overrides):
    """The quickstart task with rollouts generating from fp8 (Llama) / mxfp4 (tiny GPT-OSS, torch learner) weights:
    >= 0.8 reward, as with native ones (docs/weights.md: 0.978 and 0.998 on 2 CPU cores)."""
    res = offpolicy_run(run_overrides, *overrides, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)
    assert summary["initial_reward_mean"] < 0.15 and summary["final_reward_mean"] >= 0.8
