"""Prompt text to token ids under a data section's options: chat template, length limit, filtering.

`PromptEncoder(tokenizer, data_cfg).encode(text)` gives the ids a rollout engine receives: the text
itself, or with `chat_template` the messages [system_prompt?, user: text] rendered by the tokenizer's
template with the generation prompt and `chat_template_kwargs` (e.g. GPT-OSS's `reasoning_effort`), as
verl's RL dataset renders them (verl/utils/dataset/rl_dataset.py: apply_chat_template(tokenize=False),
then encode without special tokens); `prompt_template` first puts the text into its "{prompt}". Past `max_prompt_tokens`, `overlong_prompts` decides: "error"
raises naming the prompt, "truncate_left" keeps the last tokens, "truncate_right" the first ones, and
"filter" leaves the prompt out of the data set when it is loaded (`filter_overlong`; `encode` then
raises, as for "error"). Chat prompts (verl rows: `Prompt.messages`) always go through the template.
Reward functions always see the prompt's own text, never the template.
`PromptCounts` says how many prompts were read, filtered and truncated.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

from offpolicy.config import DataConfig
from offpolicy.data.datasets import Prompt, load_dataset

log = logging.getLogger("offpolicy.data")


@dataclass
class PromptCounts:
    read: int = 0  # prompts in the data set as loaded
    dropped_bad_rows: int = 0  # file rows left out at load: a missing field or a wrong type (data.bad_rows=drop)
    filtered_overlong: int = 0  # left out at load: over max_prompt_tokens (overlong_prompts=filter)
    truncated: int = 0  # cut to max_prompt_tokens so far (overlong_prompts=truncate_*)
    kept: int = 0  # prompts left after filtering (and eval.max_prompts)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PromptEncoder:
    def __init__(self, tokenizer, cfg: DataConfig, section: str = "data"):
        self.tokenizer, self.cfg, self.section = tokenizer, cfg, section
        self.counts = PromptCounts()
        if cfg.chat_template and not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(f"{section}.chat_template is on but the tokenizer has no chat template (the digit "
                             "tokenizer): set model.tokenizer to an HF tokenizer directory")

    def full(self, prompt: str | Prompt) -> list[int]:
        """Token ids of the prompt with its template, before any length limit. A chat prompt (a Prompt with
        messages: verl rows) always goes through the chat template, with system_prompt first unless it has one."""
        messages = list(prompt.messages) if isinstance(prompt, Prompt) else []
        text = prompt.text if isinstance(prompt, Prompt) else prompt
        if self.cfg.prompt_template and not messages:
            text = self.cfg.prompt_template.replace("{prompt}", text)
        if not messages and not self.cfg.chat_template:
            return self.tokenizer.encode(text)
        if not hasattr(self.tokenizer, "apply_chat_template"):
            raise ValueError(f"{self.section}.source has chat-message prompts (verl rows) but the tokenizer has no chat "
                             "template (the digit tokenizer): set model.tokenizer to an HF tokenizer directory")
        chat = [{"role": r, "content": c} for r, c in messages] or [{"role": "user", "content": text}]
        if self.cfg.system_prompt and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return self.tokenizer.apply_chat_template(chat, **self.cfg.chat_template_kwargs)

    def encode(self, prompt: str | Prompt, prompt_id: int | None = None) -> list[int]:
        ids = self.full(prompt)
        limit, mode = self.cfg.max_prompt_tokens, self.cfg.overlong_prompts
        if len(ids) <= limit:
            return ids
        if mode == "truncate_left":
            self.counts.truncated += 1
            return ids[-limit:]
        if mode == "truncate_right":
            self.counts.truncated += 1
            return ids[:limit]
        which = "a prompt" if prompt_id is None else f"prompt {prompt_id}"
        raise ValueError(f"{which} has {len(ids)} tokens, over {self.section}.max_prompt_tokens={limit}: raise it, "
                         f"or set {self.section}.overlong_prompts to filter, truncate_left or truncate_right")


class FilteredDataset:
    """The prompts of `dataset` that fit, renumbered 0..len-1 (prompt ids index this data set)."""

    def __init__(self, dataset, keep: list[int]):
        self.base, self.keep = dataset, keep

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> Prompt:
        return replace(self.base[self.keep[i]], id=i)


def filter_overlong(dataset, encoder: PromptEncoder):
    """With overlong_prompts=filter: the data set without prompts over max_prompt_tokens (counted in
    encoder.counts); otherwise the data set unchanged. Tokenizes every prompt once."""
    encoder.counts.read = len(dataset)
    if encoder.cfg.overlong_prompts != "filter":
        encoder.counts.kept = len(dataset)
        return dataset
    limit = encoder.cfg.max_prompt_tokens
    keep = [i for i in range(len(dataset)) if len(encoder.full(dataset[i])) <= limit]
    encoder.counts.filtered_overlong = len(dataset) - len(keep)
    encoder.counts.kept = len(keep)
    if not keep:
        raise ValueError(f"every one of the {len(dataset)} prompts of {encoder.section}.source is over "
                         f"{encoder.section}.max_prompt_tokens={limit}: raise it")
    return FilteredDataset(dataset, keep)


def hold_out(dataset, held) -> tuple[object, int]:
    """`dataset` without the prompts that are also in `held` (the same text, or the same chat messages), renumbered
    as `FilteredDataset` does, and how many were left out (eval.hold_out: no training on the eval's problems)."""
    def key(p: Prompt):
        return (p.text, tuple(p.messages))

    taken = {key(held[i]) for i in range(len(held))}
    keep = [i for i in range(len(dataset)) if key(dataset[i]) not in taken]
    if not keep:
        raise ValueError(f"eval.hold_out: every one of the {len(dataset)} prompts of data.source is also an eval.data "
                         "prompt: give eval.data other prompts (another seed or file), or set eval.hold_out=false")
    return (FilteredDataset(dataset, keep) if len(keep) < len(dataset) else dataset), len(dataset) - len(keep)


def load_prompts(cfg: DataConfig, tokenizer, section: str = "data"):
    """The data set of `cfg` with overlong prompts filtered (when asked), and its encoder; logs what was filtered."""
    encoder = PromptEncoder(tokenizer, cfg, section)
    loaded = load_dataset(cfg)
    dropped = getattr(loaded, "dropped", 0)
    if dropped:
        log.warning("%s: %d bad rows of %s left out (data.bad_rows=drop), e.g. %s", section, dropped, cfg.source,
                    "; ".join(loaded.drop_reasons[:3]))
    dataset = filter_overlong(loaded, encoder)
    encoder.counts.dropped_bad_rows = dropped
    if encoder.counts.filtered_overlong:
        log.info("%s: %d of %d prompts are over max_prompt_tokens=%d and were filtered out", section,
                 encoder.counts.filtered_overlong, encoder.counts.read, cfg.max_prompt_tokens)
    return dataset, encoder
