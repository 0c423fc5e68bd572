"""The run's fp8 block, resolved in one place: `weights.fp8_block_size` (`auto` or a block) for the run's rollout
engine and its TP size (`fp8_blocks.for_run`) against the model's checkpoint shapes (`models.build.model_shapes`:
`model.path`'s safetensors headers, or `model.arch` built on the meta device).

Every place that writes or serves fp8 versions takes its block from here, so all get the same one: the learner at
start (`learner.loop.run_learner`, which then hands the resolved block to the publisher and the backend), the
Megatron backend's publish when it is handed an unresolved `auto` (benchmarks/publish.py), and the vLLM launch
before it converts its launch checkpoint (`rollout.engines.launch.initial_model`, also for the block a
checkpoint already carries). Two readers resolve against shapes they already hold, through `fp8_blocks.for_run`
itself: the torch engine's fp8 matmul plan (its built model's tensors) and `formats.encode` given `auto` by a
caller with no run config (the torch engine's rule, `fp8_blocks.resolve(..., "torch")`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from offpolicy.config import Config, WeightsConfig
from offpolicy.models.build import model_shapes
from offpolicy.weights import fp8_blocks


def block(cfg: Config, setting: str | Sequence[int] | None = None, path: str | None = None) -> tuple[int, int]:
    """`setting` (default: the run's `weights.fp8_block_size`; e.g. a checkpoint's own block) resolved for the run's
    rollout engine against the shapes of the model at `path` (default: `model.path`, else `model.arch`). Raises
    ValueError naming the field and a block that works where the engine cannot serve it (`fp8_blocks.resolve`)."""
    return fp8_blocks.for_run(cfg, model_shapes(cfg.model, path), setting)


def resolved(cfg: Config, weights: WeightsConfig | None = None, formats: Iterable[str] = ()) -> WeightsConfig:
    """`weights` (default: `cfg.weights`) with its `fp8_block_size` resolved (`block`, with that section's setting and
    `fp8_skip`) where fp8 versions are written (fp8 in its `formats` or in `formats`); otherwise as it is."""
    w = cfg.weights if weights is None else weights
    if "fp8" not in (*w.formats, *formats):
        return w
    return msgspec.structs.replace(w, fp8_block_size=block(msgspec.structs.replace(cfg, weights=w)))
