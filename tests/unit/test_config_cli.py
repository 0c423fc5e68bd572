"""Tests for the config on the daemons' command lines: `--help` is instant, `--dry-run` prints the resolved YAML,
a bad override or a missing file exits 2 naming the field, and importing the daemons or offpolicy.config does not
import torch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from offpolicy.config import load_config, to_yaml
from tests.config_files import QUICKSTART, REPO


# --- entry points: --help, --dry-run, bad overrides; no torch on import ---------------------------

DAEMONS = ["offpolicy.services.learner", "offpolicy.services.rollout"]


def run_module(module: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("module", DAEMONS)
def test_help_is_instant(module):
    proc, seconds = run_module(module, "--help")
    assert proc.returncode == 0, proc.stderr
    assert seconds < 2.0
    assert "--dry-run" in proc.stdout and "--config" in proc.stdout and "overrides" in proc.stdout


@pytest.mark.parametrize("module", DAEMONS)
def test_dry_run_prints_the_resolved_yaml(module):
    proc, _ = run_module(module, "--dry-run", "--config", "configs/quickstart.yaml", "algo.max_staleness=0")
    assert proc.returncode == 0, proc.stderr
    assert "max_staleness: 0" in proc.stdout
    assert proc.stdout == to_yaml(load_config(QUICKSTART, ["algo.max_staleness=0"]))


@pytest.mark.parametrize("module", DAEMONS)
@pytest.mark.parametrize("override, field", [
    ("rollout.n_samples=1", "rollout.n_samples"),
    ("rollout.nsamples=4", "rollout.nsamples"),
    ("model.dtype=fp8", "model.dtype"),
])
def test_bad_override_exits_2_naming_the_field(module, override, field):
    proc, _ = run_module(module, "--dry-run", "--config", "configs/quickstart.yaml", override)
    assert proc.returncode == 2
    assert field in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("module", DAEMONS)
def test_missing_config_file_exits_2(module, tmp_path):
    proc, _ = run_module(module, "--dry-run", "--config", str(tmp_path / "none.yaml"))
    assert proc.returncode == 2
    assert "not found" in proc.stderr


@pytest.mark.parametrize("module", [*DAEMONS, "offpolicy.config"])
def test_import_does_not_load_torch(module):
    code = f"import {module}, sys; print('torch' in sys.modules, 'transformers' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False False"
