"""Learner backends: the protocol every backend implements, and the factory by config name.

A backend owns the trainable model and its optimizer. `train_step` runs one optimizer step of the
clipped-ratio policy loss on a batch of groups with given advantages and returns scalar statistics;
`weights` yields full HF-named tensors for the weight store; `hf_config` is the config.json content;
`save_checkpoint` / `load_checkpoint` write and restore model and optimizer state for `--resume`.
The embedded `torch` backend is the first implementation; the Megatron backend implements the same.

May import: config, plumbing, weights, hub, learner.algorithms, learner.loss (docs/architecture.md, "Dependency rule").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from offpolicy.config import Config
from offpolicy.hub.batch import Group

if TYPE_CHECKING:  # annotations only: importing the package (e.g. for megatron/arch.py) stays torch-free
    import torch


class LearnerBackend(Protocol):
    def train_step(self, groups: list[Group], advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step; `advantages` is `[len(groups), n]`."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors of the current policy."""

    def hf_config(self) -> dict:
        """The HF config.json content that goes with `weights()`."""

    def save_checkpoint(self, path: Path) -> None:
        """Write model and optimizer state into the directory `path` (safetensors / tensors only)."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote."""


def make_backend(cfg: Config) -> LearnerBackend:
    if cfg.learner.backend == "torch":
        from offpolicy.backends.torch_backend import TorchBackend

        return TorchBackend(cfg)
    if cfg.learner.backend == "megatron":
        from offpolicy.backends.megatron.backend import MegatronBackend

        return MegatronBackend(cfg)
    raise ValueError(f"learner.backend {cfg.learner.backend!r} is not available")
