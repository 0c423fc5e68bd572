"""verl's RL data schema, read unchanged: the rows of verl's parquet (and JSONL) files as prompts.

A row (verl/utils/dataset/rl_dataset.py, and the examples/data_preprocess scripts that write them):
    data_source   str                        where the row comes from, e.g. "openai/gsm8k"; picks its reward
    prompt        list of {role, content}    the chat messages; rendered by the tokenizer's chat template
    reward_model  {ground_truth, style}      ground_truth: the reference answer handed to the reward
    ability, extra_info                      read by nothing here (kept in the file as they are)
`verl_prompt` checks each field's presence and type and names the field of a bad row; a ground truth
that is not a string (a number, a list of test cases) reaches the reward as JSON text.
"""

from __future__ import annotations

import json

from offpolicy.data.prompt import Prompt

ROLES = ("system", "user", "assistant", "tool")


def _bad(where: str, field: str, problem: str) -> ValueError:
    return ValueError(f"{where}: field {field!r} {problem} (verl's schema: prompt = [{{role, content}}, ...], "
                      "reward_model = {ground_truth, style}, data_source = str)")


def messages_of(prompt, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(prompt, (list, tuple)) or not prompt:
        kind = "an empty list" if isinstance(prompt, (list, tuple)) else f"a {type(prompt).__name__}"
        raise _bad(where, "prompt", f"is {kind}, not a list of chat messages")
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise _bad(where, f"prompt[{i}]", f"is a {type(m).__name__}, not a message {{role, content}}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                problem = "is missing" if m.get(key) is None else f"is a {type(m[key]).__name__}, not a string"
                raise _bad(where, f"prompt[{i}].{key}", problem)
        if m["role"] not in ROLES:
            raise _bad(where, f"prompt[{i}].role", f"is {m['role']!r}, not one of {', '.join(ROLES)}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def ground_truth_of(reward_model, where: str) -> str:
    if not isinstance(reward_model, dict):
        raise _bad(where, "reward_model", f"is a {type(reward_model).__name__}, not a mapping with a ground_truth")
    if reward_model.get("ground_truth") is None:
        raise _bad(where, "reward_model.ground_truth", "is missing")
    truth = reward_model["ground_truth"]
    return truth if isinstance(truth, str) else json.dumps(truth)


def verl_prompt(row: dict, where: str, prompt_id: int) -> Prompt:
    """The prompt of one verl row (raises ValueError naming the field when the row does not fit)."""
    if "prompt" not in row:
        raise _bad(where, "prompt", "is missing")
    if "reward_model" not in row:
        raise _bad(where, "reward_model", "is missing")
    messages = messages_of(row["prompt"], where)
    source = row.get("data_source", "")
    if not isinstance(source, str):
        raise _bad(where, "data_source", f"is a {type(source).__name__}, not a string")
    users = [c for r, c in messages if r == "user"]
    return Prompt(id=prompt_id, text=users[-1] if users else messages[-1][1],
                  answer=ground_truth_of(row["reward_model"], where), messages=messages, data_source=source)
