"""Tokenizers: the built-in digit tokenizer for the synthetic tasks, or an HF tokenizer directory.

Both expose the same small surface: `encode(text) -> list[int]` (with BOS where the tokenizer uses
one), `decode(ids) -> str` (up to the first stop id: EOS, and those added by `stop_at`), `eos_token_id`,
`pad_token_id`, `vocab_size`. An HF tokenizer also renders chat messages through its chat template
(`apply_chat_template`). The rollouts and the evaluator decode a response for its reward up to the first id the
engines stop on (`rollout.engines.response_tokenizer`): GPT-OSS ends on `<|return|>` or `<|call|>`, not on its
tokenizer's EOS, and that text must not reach a reward.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def stop_at(self, ids) -> Tokenizer: ...


def _until_stop(ids, stops: frozenset[int]) -> list[int]:
    """`ids` as ints, up to (not including) the first one in `stops`."""
    out = []
    for i in ids:
        i = int(i)
        if i in stops:
            break
        out.append(i)
    return out


class _Stops:
    """`decode` ends at the first of `stop_ids` (EOS, and what `stop_at` adds)."""

    stop_ids: frozenset[int]

    def stop_at(self, ids):
        """Also end `decode` at these ids (the ids the engines stop on); returns self."""
        self.stop_ids = self.stop_ids | {int(i) for i in ids}
        return self


class DigitTokenizer(_Stops):
    """Characters 0-9, '=' and ' ', plus PAD, BOS and EOS: 16 ids (a tiny model's whole vocabulary)."""

    CHARS = "0123456789"
    PAD, BOS, EQ, EOS, SPACE = 10, 11, 12, 13, 14
    vocab_size = 16
    eos_token_id = EOS
    pad_token_id = PAD
    bos_token_id = BOS

    def __init__(self) -> None:
        self._ids = {c: i for i, c in enumerate(self.CHARS)} | {"=": self.EQ, " ": self.SPACE}
        self._chars = {i: c for c, i in self._ids.items()}
        self.stop_ids = frozenset({self.EOS})

    def encode(self, text: str) -> list[int]:
        try:
            return [self.BOS] + [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"digit tokenizer cannot encode {e.args[0]!r} in {text!r}: use digits, '=' and ' '") from None

    def decode(self, ids) -> str:
        return "".join(self._chars.get(i, "?") for i in _until_stop(ids, self.stop_ids))


class HFTokenizer(_Stops):
    """A `transformers` tokenizer loaded from a directory (imported late)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {path} has no EOS token: set one in its tokenizer_config.json")
        self.eos_token_id = self._tok.eos_token_id
        self.pad_token_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(self._tok)
        self.stop_ids = frozenset({self.eos_token_id})

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs) -> list[int]:
        """Token ids of `messages` rendered by the tokenizer's chat template with the generation prompt;
        `kwargs` are template variables (e.g. reasoning_effort). As verl's RL dataset does: render to
        text, then encode without adding special tokens again (the template writes its own)."""
        if not self._tok.chat_template:
            raise ValueError(f"tokenizer at {self.path} has no chat_template: set data.chat_template=false or use a "
                             "tokenizer whose tokenizer_config.json (or chat_template.jinja) has one")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode(_until_stop(ids, self.stop_ids))


def load_tokenizer(spec: str) -> Tokenizer:
    """"digits" for the built-in tokenizer, otherwise a directory holding an HF tokenizer."""
    return DigitTokenizer() if spec == "digits" else HFTokenizer(spec)
