"""Every entry point, run directly as an operator (or srun) would, fails on bad input with one line
that names the field and the fix, exit code 2 and no traceback (issue 26): busy ports (the learner's
ZMQ, metrics and Megatron rendezvous ports, a rollout's metrics port), a model.path or tokenizer
pointing nowhere, `--resume` with nothing to resume, `--weights` that does not exist."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, daemon_cmd

CLI = [sys.executable, "-m", "offpolicy.services.cli"]


def run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, res.stderr
    return err


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("entry, field", [
    ("learner", "transport.work_port"), ("learner", "transport.announce_port"), ("learner", "metrics.port"),
    ("learner", "learner.megatron.master_port"), ("rollout", "metrics.port"), ("eval_daemon", "metrics.port"),
    ("run", "transport.work_port"), ("run", "learner.megatron.master_port")])
def test_a_busy_port_names_its_field(run_overrides, busy_port, entry, field):
    extra = [f"{field}={busy_port}", "eval.every_versions=1"]
    if field.startswith("learner.megatron"):
        extra.append("learner.backend=megatron")
    cmd = ([*CLI, "run", QUICKSTART] if entry == "run" else daemon_cmd(entry, "--config", QUICKSTART))
    err = run([*cmd, *run_overrides, *extra])
    assert f"{field}={busy_port}" in err and "pick free ports, e.g." in err


@pytest.mark.parametrize("entry", ["learner", "rollout", "eval_daemon", "run", "offpolicy eval"])
@pytest.mark.parametrize("field, value", [("model.path", "/nowhere/model"), ("model.path", "Qwen/Not-Downloaded"),
                                          ("model.tokenizer", "/nowhere/tokenizer")])
def test_a_model_or_tokenizer_pointing_nowhere_names_the_field(run_overrides, entry, field, value):
    cmd = {"run": [*CLI, "run", QUICKSTART], "offpolicy eval": [*CLI, "eval", "--config", QUICKSTART]}.get(
        entry) or daemon_cmd(entry, "--config", QUICKSTART)
    err = run([*cmd, *run_overrides, f"{field}={value}", "eval.every_versions=1"])
    assert f"config field {field}: {value} does not exist" in err
    if "/" in value and not value.startswith("/"):
        assert "huggingface-cli download" in err


def test_a_model_path_without_config_json(run_overrides, tmp_path):
    err = run([*daemon_cmd("learner", "--config", QUICKSTART), *run_overrides, f"model.path={tmp_path}"])
    assert f"config field model.path: {tmp_path} has no config.json" in err


@pytest.mark.parametrize("entry", ["learner", "run"])
def test_resume_with_nothing_to_resume(run_overrides, entry):
    cmd = [*CLI, "run", QUICKSTART] if entry == "run" else daemon_cmd("learner", "--config", QUICKSTART)
    err = run([*cmd, *run_overrides, "--resume"])
    assert "--resume: no run directory" in err and "start without --resume" in err
    (run_overrides.run_dir / "quickstart" / "checkpoints").mkdir(parents=True)
    err = run([*cmd, *run_overrides, "--resume"])
    assert "holds no complete checkpoint" in err


def test_eval_weights_that_do_not_exist(run_overrides):
    err = run([*CLI, "eval", "--config", QUICKSTART, *run_overrides, "--weights", "/tmp/nope-offpolicy"])
    assert err.startswith("error: --weights /tmp/nope-offpolicy does not exist")


@pytest.mark.parametrize("entry", ["learner", "run"])
def test_megatron_without_megatron_core_names_the_extra(run_overrides, tmp_path, entry):
    """The quickstart set-up leaves megatron-core out; a megatron learner says which extra to install."""
    (tmp_path / "site" / "megatron").mkdir(parents=True)
    (tmp_path / "site" / "megatron" / "__init__.py").write_text("")  # a megatron package without core
    cmd = [*CLI, "run", QUICKSTART] if entry == "run" else daemon_cmd("learner", "--config", QUICKSTART)
    res = subprocess.run([*cmd, *run_overrides, "learner.backend=megatron"], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")})
    err = res.stderr.strip()
    assert res.returncode == 2 and err.count("\n") == 0, res.stderr
    assert "learner.backend: megatron needs megatron-core" in err and "pip install -e '.[megatron]'" in err


@pytest.mark.parametrize("argv, said", [
    (["plot", "/nope-offpolicy"], "/nope-offpolicy does not exist: give run directories"),
    (["plot", "/tmp"], "/tmp has no metrics.jsonl"),
    (["verify", "--model", "/nope-offpolicy"], "option --model: /nope-offpolicy does not exist"),
    (["verify", "--model", "/tmp"], "option --model: /tmp has no config.json"),
    (["keys", "/proc/nope-offpolicy"], "cannot write keys into /proc/nope-offpolicy"),
    (["stores", "--root", "/nope-offpolicy", "--free", "x"], "no store 'x' in /nope-offpolicy")])
def test_subcommands_fail_in_one_line(argv, said):
    assert said in run([*CLI, *argv])
