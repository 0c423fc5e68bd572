"""A reward for tests that keeps what it scored: `recording(prompt, answer, response)` is the `reasoning_gym`
reward, and appends {answer, response, reward} to the JSONL file named by OFFPOLICY_TEST_REWARD_LOG (set by
the test for the daemons it starts), so a test can check that rewards were computed from the decoded text
of real generations. Use as `rollout.reward=tests.recording_reward:recording` (daemons started in the repo root)."""

from __future__ import annotations

import json
import os

from offpolicy.data.rewards import get_reward


def recording(prompt: str, answer: str, response: str) -> float:
    reward = get_reward("reasoning_gym")(prompt, answer, response)
    with open(os.environ["OFFPOLICY_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"answer": answer, "response": response, "reward": reward}) + "\n")
    return reward
