"""Small versions for the tests of the weight store (tests/unit/test_weights_store.py, _version.py, _subscribe.py).

`small_tensors(seed)` draws four seeded float32 tensors named as in a Llama checkpoint; `publish(store, v)`
publishes them (or the given ones) as version `v` of run `RUN`; `hidden_entries` lists a run directory's
hidden entries (temporary and collected versions); `sha256` hashes a file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from offpolicy.weights import Published, WeightStore

RUN = "unit"


def small_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def publish(store: WeightStore, version: int, tensors: dict[str, torch.Tensor] | None = None,
            config: dict | None = None) -> Published:
    tensors = small_tensors(version) if tensors is None else tensors
    return store.publish(version, iter(tensors.items()), config or {"model_type": "llama", "v": version})


def hidden_entries(run_dir: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(run_dir) if e.name.startswith("."))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
