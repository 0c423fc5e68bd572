"""Configs for the tests of offpolicy.config (tests/unit/test_config_*.py): the quickstart's path, `load` (the
built-in defaults plus the smallest model that makes them valid, then overrides), and `write` (a YAML file in a
test's tmp_path)."""

from __future__ import annotations

from pathlib import Path

from offpolicy.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


# The built-in defaults name no model; this is the smallest addition that makes them valid.
ARCH = ["model.arch.model_type=llama"]


def load(*overrides: str) -> Config:
    return load_config(None, [*ARCH, *overrides])


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path
