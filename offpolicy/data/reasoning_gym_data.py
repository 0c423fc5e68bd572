"""`data.source: reasoning_gym`: prompts drawn from a reasoning-gym task, scored by that task's own scorer.

`ReasoningGymTask(cfg)` is the data set: `reasoning_gym.create_dataset(task, seed=, size=, **config)`,
whose entry i (generated on demand, the same for the same seed) is prompt i: its question is the prompt
text. The prompt's answer is a small JSON key, `{"task", "seed", "size", "config", "index"}`: the
`reasoning_gym` reward (offpolicy/data/rewards.py) rebuilds the task from it in whatever process scores
(rollout daemon, eval), takes entry `index` exactly as generated, and returns the task's own
`score_answer(answer, entry)`. The answer scored is what the response puts in `<answer>...</answer>`
(reasoning-gym's convention, `reasoning_gym.utils.extract_answer`), else the whole response, stripped; the
`reasoning_gym_final` reward reads, failing the tags, the response's final answer as a math grader does (the
last number of "6 + 5 = 11"), for models that answer in a sentence rather than in tags.
"""

from __future__ import annotations

import json
from functools import lru_cache

from offpolicy.config import ReasoningGymConfig
from offpolicy.data.prompt import Prompt


def _create(task: str, seed: int, size: int, config: str):
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("data.source is reasoning_gym but reasoning-gym is missing: "
                         "pip install 'offpolicy[reasoning-gym]'") from None
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"data.reasoning_gym.task {task!r} is not a reasoning-gym task: use one of "
                         f"{', '.join(sorted(DATASETS))}")
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config))
    except (TypeError, AssertionError, ValueError) as e:  # the task's config class refuses a field or a value
        raise ValueError(f"data.reasoning_gym.config {config} does not fit task {task!r}: {e}") from None


@lru_cache(maxsize=16)
def task_dataset(task: str, seed: int, size: int, config: str):
    """The reasoning-gym data set of these settings (`config` as canonical JSON), made once per process."""
    return _create(task, seed, size, config)


class ReasoningGymTask:
    """Prompt i = entry i of the task; the answer is the key the `reasoning_gym` reward scores against."""

    def __init__(self, cfg: ReasoningGymConfig):
        self.cfg = cfg
        self.config = json.dumps(cfg.config, sort_keys=True)
        self.dataset = task_dataset(cfg.task, cfg.seed, cfg.size, self.config)

    def __len__(self) -> int:
        return self.cfg.size

    def __getitem__(self, i: int) -> Prompt:
        if not 0 <= i < len(self):
            raise IndexError(i)
        key = {"task": self.cfg.task, "seed": self.cfg.seed, "size": self.cfg.size, "config": self.cfg.config, "index": i}
        return Prompt(id=i, text=self.dataset[i]["question"], answer=json.dumps(key, sort_keys=True),
                      data_source=f"reasoning_gym/{self.cfg.task}")


def extracted(response: str, final: bool = False) -> str:
    """The answer part of a response: its last <answer>...</answer>, else (`final`) its final answer as a math
    grader reads it (`math_answers.extract_answer`: \\boxed{}, `#### x`, "the answer is x", the last number),
    else the whole response, stripped."""
    from reasoning_gym.utils import extract_answer

    found = extract_answer(response)
    if found is None and final:
        from offpolicy.data.math_answers import extract_answer as final_answer

        found = final_answer(response)
    return found if found is not None else response.strip()


def score(key: str, response: str, final: bool = False) -> float:
    """The task's own score of `response` for the entry named by `key` (a ReasoningGymTask answer), on the
    response's <answer> or, failing that, its whole text (`final`: its final answer; see `extracted`)."""
    try:
        k = json.loads(key)
        ds = task_dataset(k["task"], k["seed"], k["size"], json.dumps(k["config"], sort_keys=True))
        entry = ds[k["index"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"the reasoning_gym reward needs prompts of data.source=reasoning_gym; this answer is not "
                         f"one of their keys ({type(e).__name__}: {e}): {key[:80]!r}") from None
    return float(ds.score_answer(answer=extracted(response, final), entry=entry))
