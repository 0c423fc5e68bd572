"""Learner backends: the protocol every backend implements, and the factory by config name.

A backend owns the trainable model and its optimizer. `train_step` runs one optimizer step of the
clipped-ratio policy loss on a batch of groups with given advantages and returns scalar statistics;
`weights` yields full HF-named tensors for the weight store; `hf_config` is the config.json content;
`save_checkpoint` / `load_checkpoint` write and restore model and optimizer state for `--resume`;
`publish` starts a weight version written by every rank of a sharded backend (or returns None: then the
publisher writes `weights()`); `startup` holds the start-up phases; `serve` is the loop of a worker rank
(ranks 1..k of a multi-process backend); `close` ends it. The embedded `torch` backend is the first
implementation; the Megatron backend implements the same, and tests/unit/test_contracts.py holds each
implementation against this protocol (no caller probes a backend with hasattr/getattr).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from offpolicy.config import Config
from offpolicy.hub.batch import Group

if TYPE_CHECKING:  # annotations only: importing the package (e.g. for megatron/arch.py) stays torch-free
    import torch

    from offpolicy.config import WeightsConfig
    from offpolicy.weights.sharded import Pending


class LearnerBackend(Protocol):
    startup: dict[str, float]  # start-up phases in seconds ("ready" the total), {} where none are measured

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

    def publish(self, version: int, fmts: list[str], w: WeightsConfig, run: str) -> Pending | None:
        """Start writing `version` in each of `fmts` from every rank's own shards (weights/sharded.py); returns
        rank 0's pending version (its `wait()` commits it), or None where the backend writes no shards of its
        own: the publisher then writes `weights()`."""

    def serve(self) -> None:
        """A worker rank (1..k): run rank 0's commands until `close`; returns at once where there are none."""

    def close(self) -> None:
        """Rank 0: release the worker ranks; idempotent."""


def make_backend(cfg: Config) -> LearnerBackend:
    if cfg.learner.backend == "torch":
        from offpolicy.learner.backends.torch_backend import TorchBackend

        return TorchBackend(cfg)
    if cfg.learner.backend == "megatron":
        from offpolicy.learner.backends.megatron.backend import MegatronBackend

        return MegatronBackend(cfg)
    raise ValueError(f"learner.backend {cfg.learner.backend!r} is not available")
