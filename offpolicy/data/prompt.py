"""`Prompt`: one prompt of a data set, as the hub leases it and the reward function scores it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: int  # prompt id: its index in the data set
    text: str  # the prompt as the reward function sees it (chat prompts: the last user message)
    answer: str = ""  # reference answer for the reward function
    messages: tuple[tuple[str, str], ...] = ()  # chat prompts (verl rows): (role, content) pairs, rendered by the chat template
    data_source: str = ""  # where the row comes from (verl's data_source); picks its reward (data.reward_by_source)
