"""Reward functions: a registry by name, `fn(prompt_text, answer, response_text) -> float`.

Built-ins score the synthetic digit tasks. A name of the form `package.module:function` imports a
user's function, so a run can bring its own verifier without changing offpolicy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]
_REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


def get_reward(name: str) -> RewardFn:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"rollout.reward {name!r} cannot be imported: {e}") from None
    raise ValueError(f"rollout.reward {name!r} is unknown: use one of {', '.join(sorted(_REGISTRY))} "
                     "or 'package.module:function'")


@register("digits_partial")
def digits_partial(prompt: str, answer: str, response: str) -> float:
    """Partial credit in [0, 1]: one point per character in the right place, one for the right length.

    Points are divided by (longer of answer and response) + 1, so only the exact answer scores 1 and
    rambling past the answer is penalised through the longer denominator and the lost length point.
    """
    hits = sum(a == b for a, b in zip(answer, response))
    return hits / (max(len(answer), len(response)) + 1) + (len(response) == len(answer)) / (len(answer) + 1)


@register("exact_match")
def exact_match(prompt: str, answer: str, response: str) -> float:
    return float(response.strip() == answer.strip())


@register("python_tests")
def python_tests(prompt: str, answer: str, response: str) -> float:
    """1.0 if the response's Python code passes the tests in `answer` (asserts), else 0.0.

    The code is the response's last ```python fenced block (or the whole response); it runs with the
    tests appended in `offpolicy.sandbox`: 5 s, 512 MB, no network.
    """
    from offpolicy.sandbox import run_python

    blocks = response.split("```python")
    code = blocks[-1].split("```")[0] if len(blocks) > 1 else response
    return float(run_python(code + "\n" + answer, timeout_s=5.0, memory_mb=512).returncode == 0)
