"""The torch engine's prefill in chunks of prompt positions, so that the attention scores fit (`chunk_tokens`).

Why: HF's GPT-OSS runs eager attention (its sinks; `_supports_sdpa = False` in transformers 5), which holds the
prefill's scores as `rows x heads x prompt x (prompt + 1)` values, and its softmax a few more copies of them: 256
rows of 500-token prompts with 64 heads are 8.2 GB a copy in bf16, tens of GB at the peak, beside a learner on the
same GPU. Fed in chunks of C positions (the KV cache of the earlier ones kept: the same forward, in pieces, as a
decode step is one position), a chunk's scores are `rows x heads x C x (seen + C)`.

Invariants:
- `chunk_tokens(...)` is the whole prompt (one forward, as before) for a model without eager attention (sdpa's
  kernels hold no score matrix) and wherever one copy of the whole prompt's scores in float32 fits `budget` bytes;
  else the largest multiple of 16 positions whose last chunk's scores fit, at least 16.
  `rollout.prefill_chunk_tokens` > 0 sets it instead, whatever the attention (0: this rule, `PREFILL_SCORE_BYTES`).
- The chunks are fed in order with the attention mask of every position up to the chunk's end and the chunk's own
  position ids; the lm_head runs at each chunk's last position only (`logits_to_keep=1`), and the last chunk's is the
  prefill's: the same logits as one forward, up to the order of floating-point sums.
"""

from __future__ import annotations

PREFILL_SCORE_BYTES = 1 << 30  # one float32 copy of the prefill's attention scores, at most (prefill_chunk_tokens 0)
QUANTUM = 16  # chunks are multiples of this many positions


def chunk_tokens(rows: int, heads: int, width: int, setting: int = 0, budget: int = PREFILL_SCORE_BYTES,
                 eager: bool = True) -> int:
    """Prompt positions a prefill forward takes at once, for `rows` prompts `width` wide (left-padded) and `heads`
    attention heads; `setting` is rollout.prefill_chunk_tokens (> 0: that many, 0: by `budget` where `eager`)."""
    if setting > 0:
        return min(setting, width)
    whole = rows * heads * width * (width + 1) * 4
    if not eager or whole <= budget:
        return width
    per_position = rows * heads * (width + 1) * 4  # a chunk's rows of scores reach at most the whole width
    return min(width, max(QUANTUM, budget // per_position // QUANTUM * QUANTUM))


def spans(width: int, chunk: int) -> list[tuple[int, int]]:
    """The chunks' [start, end) positions."""
    return [(s, min(width, s + chunk)) for s in range(0, width, chunk)]
