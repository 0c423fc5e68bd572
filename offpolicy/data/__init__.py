"""Prompt data and its scoring: data sets, prompt encoding, tokenizers, rewards and the code sandbox.

Modules: `datasets` (`load_dataset`: synthetic digits, JSONL / Parquet rows, reasoning-gym), `prompt`
(`Prompt`), `prompts` (`PromptEncoder`: chat template, length limit, filtering), `verl_rows` (verl's
RL schema), `reasoning_gym_data`, `tokenizer` (digit or HF tokenizers), `rewards` (the reward
registry), `math_answers` (the `math` reward's final-answer extraction and equivalence), `sandbox`
(runs generated code). Nothing is imported here, so each module stays as light as its own imports.

May import: config, plumbing (docs/architecture.md, "Dependency rule").
"""
