"""A byte-level HF tokenizer built on this machine (no download), with a harmony-style chat template.

`build_tokenizer(dir)` writes a `PreTrainedTokenizerFast` directory: one token per byte (GPT-2's
byte-to-unicode alphabet, no merges, so any text encodes) plus harmony's special tokens, and a chat
template written here in the shape of GPT-OSS's (the harmony format: `<|start|>role<|message|>...<|end|>`,
a system message that states `Reasoning: {{ reasoning_effort }}` with "medium" by default, and the
generation prompt `<|start|>assistant`). It is not OpenAI's template; it exercises the same variables.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"]

HARMONY_TEMPLATE = (
    "{%- set effort = reasoning_effort | default('medium') -%}"
    "<|start|>system<|message|>You are a helpful assistant.\nReasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|start|>developer<|message|># Instructions\n\n{{ m['content'] }}<|end|>"
    "{%- else -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map (256 characters)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tokenizer(path: str | Path, chat_template: str | None = HARMONY_TEMPLATE) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:5])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return Path(path)
