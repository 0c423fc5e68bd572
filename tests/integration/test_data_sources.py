"""Users' data on real daemons: a verl-schema parquet written by pyarrow trains unconverted (chat prompts
through the template, ground truths to the reward, data_source picking it); a reasoning-gym task trains
with its own scorer and its reward goes up (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.hf_tokenizer import build_tokenizer
from tests.integration.helpers import check_run_invariants, read_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

BYTE_LLAMA = ("model.arch={model_type: llama, vocab_size: 262, hidden_size: 32, intermediate_size: 64, "
              "num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 512, "
              "tie_word_embeddings: false, bos_token_id: 256, eos_token_id: 256, pad_token_id: 257}")


def truth_is_42(prompt: str, answer: str, response: str) -> float:
    """The reward of source "gsm8k-like" rows in the test: 1 when the ground truth reached it as written."""
    return float(answer == "42")


def run(cfg_overrides: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", "configs/quickstart.yaml", *cfg_overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_a_verl_parquet_trains_unconverted(run_overrides, tmp_path):
    rows = []
    for i in range(64):
        a = i % 2 == 0
        rows.append({"data_source": "gsm8k-like" if a else "other",
                     "prompt": [{"role": "user", "content": f"Question {i}: what is 6*7?"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42" if a else "41"},
                     "extra_info": {"split": "train", "index": i}})
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tok = build_tokenizer(tmp_path / "tok")
    res = run([*run_overrides, f"model.tokenizer={tok}", BYTE_LLAMA, "data.source=parquet", f"data.files=[{path}]",
               "data.max_prompt_tokens=256",
               "data.reward_by_source={gsm8k-like: 'tests.integration.test_data_sources:truth_is_42'}",
               "rollout.reward=exact_match", "rollout.n_samples=4", "rollout.max_new_tokens=4", "rollout.groups_per_lease=4",
               "learner.batch_groups=8", "learner.micro_batch_groups=8", "learner.total_steps=5", "run.rollouts=1"])
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == 5
    # each step's reward is the share of "gsm8k-like" groups in its batch: 1 from truth_is_42 (the ground truth
    # arrived), ~0 from exact_match for the "other" rows (a random 4-byte response is never "41")
    trained = read_jsonl(run_dir / "trained.jsonl")
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        ids = [t["prompt_id"] for t in trained if t["step"] == r["step"]]
        assert r["reward_mean"] == pytest.approx(sum(i % 2 == 0 for i in ids) / len(ids))


@pytest.mark.slow
def test_a_reasoning_gym_task_learns_with_its_scorer(run_overrides, tmp_path):
    """letter_counting with 1-3 words (answers mostly "1"): from ~0.01 the reward rises past 0.15 within
    80 steps (docs/data.md has the measured run)."""
    pytest.importorskip("reasoning_gym")
    tok = build_tokenizer(tmp_path / "tok")
    res = run([*run_overrides, f"model.tokenizer={tok}", BYTE_LLAMA.replace("hidden_size: 32, intermediate_size: 64, "
               "num_hidden_layers: 1", "hidden_size: 64, intermediate_size: 256, num_hidden_layers: 2"),
               "data.source=reasoning_gym", "data.max_prompt_tokens=128",
               "data.reasoning_gym={task: letter_counting, seed: 0, size: 5000, config: {min_words: 1, max_words: 3}}",
               "rollout.reward=reasoning_gym", "rollout.n_samples=8", "rollout.max_new_tokens=4",
               "learner.lr=0.002", "learner.total_steps=80", "run.rollouts=1"], timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)
    rewards = [r["reward_mean"] for r in read_jsonl(run_overrides.run_dir / "quickstart" / "metrics.jsonl")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.05 and last > 0.15, (first, last, summary)
