"""Tests for offpolicy.rollout.engines.sglang.launch and the launcher's SGLang servers (rollout.sglang.mode http with no
urls under `offpolicy run`): the command line SGLang's parser takes, one server per rollout daemon on its GPUs and
port, the daemon told its server's URL, the config's refusals naming their fields."""

from __future__ import annotations

import subprocess
import sys

import pytest

from offpolicy.config import ConfigError, load_config
from offpolicy.launch import run as launcher_mod
from offpolicy.launch.placement import is_server, launched_servers, placement, ports_in_use, sglang_shares
from offpolicy.plumbing.ports import free_block
from offpolicy.rollout.engines.sglang.launch import cli_flags, server_command, server_url
from offpolicy.rollout.engines.sglang.servers import SGLangServers
from offpolicy.rollout.engines.sglang.worker import LOADER
from tests.conftest import QUICKSTART

HTTP = ["rollout.engine=sglang", "rollout.sglang.mode=http", "run.rollouts=2"]


def cfg(*overrides: str):
    return load_config(QUICKSTART, [*HTTP, *overrides])


def test_the_server_command_gives_sglang_the_runs_server_arguments_as_its_flags():
    c = cfg("rollout.sglang.tp_size=2", "rollout.sglang.mem_fraction_static=0.5", "rollout.seed=7",
            "rollout.sglang.attention_backend=triton", "rollout.sglang.server_port=31000",
            "rollout.sglang.extra={disable_cuda_graph: true, chunked_prefill_size: 4096}")
    cmd = server_command(c, "/models/initial", 1)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = cmd[3:]

    def value(flag: str) -> str:
        return flags[flags.index(flag) + 1]

    assert value("--model-path") == "/models/initial" and value("--tp-size") == "2"
    assert value("--random-seed") == "8"  # rollout.seed + the daemon's index
    assert value("--mem-fraction-static") == "0.5" and value("--attention-backend") == "triton"
    assert value("--chunked-prefill-size") == "4096" and "--disable-cuda-graph" in flags
    assert "--skip-tokenizer-init" in flags and "--enable-metrics" not in flags  # booleans as SGLang's store_true
    assert "--attn-dp-size" not in flags  # SGLang's default, and unknown to 0.5.14's parser
    loaders = flags[flags.index("--custom-weight-loader") + 1:]
    assert loaders[0] == LOADER  # the fingerprint proof's loader, registered at launch
    assert flags[-4:] == ["--host", "127.0.0.1", "--port", "31001"] and server_url(c, 1) == "http://127.0.0.1:31001"
    assert "--enable-deterministic-inference" not in flags
    assert "--enable-deterministic-inference" in server_command(cfg("rollout.seed_per_prompt=true"), "/m", 0)


def test_rollout_sglang_launch_replaces_the_interpreter_and_module():
    cmd = server_command(cfg("rollout.sglang.launch=[/opt/sglang/bin/python, -m, sglang.launch_server]"), "/m", 0)
    assert cmd[:4] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path"]


def test_cli_flags_write_lists_as_arguments_and_dicts_as_json():
    assert cli_flags({"a_b": [1, "x"], "c": {"k": 1}, "d": None, "e": False, "f": True, "g": 0.5}) == [
        "--a-b", "1", "x", "--c", '{"k": 1}', "--f", "--g", "0.5"]


def test_http_without_urls_launches_a_server_per_daemon_on_its_ports_and_the_daemons_take_the_config_as_it_is():
    port = free_block(2)  # free now, so that only the socket below takes one
    c = cfg(f"rollout.sglang.server_port={port}")
    assert launched_servers(c) == "sglang" and sglang_shares(c) is None
    assert launched_servers(cfg("rollout.sglang.urls=[http://127.0.0.1:30000, http://127.0.0.1:30001]")) is None
    assert launched_servers(cfg("rollout.sglang.mode=engine", "model.path=/m")) is None
    assert is_server("sglang-0") and is_server("vllm-1") and not is_server("rollout-0")
    busy = ports_in_use(c)
    assert all("sglang" not in b for b in busy)  # (free here; the fields they would name:)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 1))
        s.listen()
        assert any("rollout.sglang.server_port (+1)" in b for b in ports_in_use(c))


def test_the_launcher_starts_each_server_on_its_daemons_gpu_and_gives_the_daemon_its_url(tmp_path, monkeypatch):
    spawned = []

    class FakePopen:
        def __init__(self, cmd, env=None, **kw):
            if "offpolicy.launch.reaper" not in cmd:
                spawned.append((cmd, env))
            self.returncode, self.pid, self.stdin = 0, 4711, None

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    overrides = [*HTTP, f"run.dir={tmp_path}", "run.rollout_gpus=[2, 3]", "rollout.sglang.server_port=31000"]
    launcher = launcher_mod.Launcher(str(QUICKSTART), overrides, load_config(QUICKSTART, overrides))
    launcher.start()
    assert list(launcher.procs) == ["sglang-0", "sglang-1", "learner", "rollout-0", "rollout-1"]
    servers, daemons = spawned[:2], spawned[3:]
    for i, (cmd, env) in enumerate(servers):
        assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[-1] == str(31000 + i)
        assert cmd[cmd.index("--model-path") + 1] == str(launcher.dir / "sglang-initial-model")
        assert env["CUDA_VISIBLE_DEVICES"] == str(2 + i)  # the server takes the daemon's GPU
    for i, (cmd, env) in enumerate(daemons):
        assert cmd[-1] == f"rollout.sglang.urls=[http://127.0.0.1:{31000 + i}]" and cmd[-3:-1] == ["--index", str(i)]
        assert "CUDA_VISIBLE_DEVICES" not in (env or {})  # the server, not the daemon, takes the GPU
    assert (launcher.dir / "sglang-initial-model" / "config.json").exists()  # same seed: version 0's weights


@pytest.mark.parametrize(("overrides", "field"), [
    (["rollout.sglang.server_port=55536"], "rollout.sglang.server_port"),  # + 10000 for gRPC: not a port
    (["rollout.sglang.extra={tp_size: 2}"], "rollout.sglang.extra"),  # a field of our own, through extra
    (["rollout.sglang.mode=engine", "model.path=/m", "rollout.sglang.urls=[http://127.0.0.1:30000]"],
     "rollout.sglang.urls"),
])
def test_what_a_launch_cannot_take_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg(*overrides)


def test_a_daemon_with_no_servers_says_how_to_get_some():
    with pytest.raises(ValueError, match=r"rollout\.sglang\.urls is empty: .*`offpolicy run`"):
        SGLangServers(cfg().rollout.sglang)


def test_placement_names_no_server_as_a_daemon():
    assert [n for n, *_ in placement(cfg())] == ["learner", "rollout-0", "rollout-1"]
