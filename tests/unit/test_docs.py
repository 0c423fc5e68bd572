"""Docs stay true to the code: every config field is documented, the README's commands are CI's."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from offpolicy import config

ROOT = Path(__file__).resolve().parents[2]


def _fields(struct, prefix=""):
    for f in msgspec.structs.fields(struct):
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            yield from _fields(f.type, f"{prefix}{f.name}.")
        else:
            yield prefix, f.name


@pytest.mark.parametrize("prefix, name", list(_fields(config.Config)), ids=lambda x: x)
def test_every_config_field_is_in_docs_config_md(prefix, name):
    text = (ROOT / "docs" / "config.md").read_text()
    section = text.split(f"## `{prefix.rstrip('.')}`", 1)
    assert len(section) == 2, f"docs/config.md has no section for {prefix.rstrip('.')}"
    assert f"| `{name}` |" in section[1].split("\n## ", 1)[0], f"{prefix}{name} is not documented"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[test]' && "
               "bash deploy/vllm/install-cpu.sh && pytest")
    assert command in readme and command in ci
    assert "offpolicy run configs/quickstart.yaml" in readme.split("---")[0]
