"""Tests for offpolicy.relay.topology: chain and tree order, healing order, the node list from config
or from Slurm (a real `scontrol` stand-in on PATH), this relay's index, bind addresses, config checks;
and the `offpolicy-relay` entry point's --help, --dry-run and config errors (real subprocesses)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from offpolicy.config import ConfigError, load_config
from offpolicy.relay import topology
from tests.conftest import QUICKSTART

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg(*overrides: str):
    return load_config(QUICKSTART, list(overrides))


# ---------------------------------------------------------------- tree order and healing order


def test_fanout_one_is_a_chain_from_the_source():
    assert [topology.parent(i, 1) for i in range(5)] == [-1, 0, 1, 2, 3]
    assert topology.upstreams(0, 1) == [-1]
    assert topology.upstreams(3, 1) == [2, 1, 0, -1]


def test_fanout_two_is_a_binary_tree_under_relay_zero():
    assert [topology.parent(i, 2) for i in range(7)] == [-1, 0, 0, 1, 1, 2, 2]
    assert topology.upstreams(6, 2) == [2, 0, -1]
    assert topology.upstreams(4, 2) == [1, 0, -1]


# ---------------------------------------------------------------- the node list


def test_configured_nodes_come_first_in_their_order():
    assert topology.relay_hosts(cfg("relay.nodes=[n3,n1,n2]"), env={}) == ["n3", "n1", "n2"]


def fake_scontrol(tmp_path, hosts: list[str]) -> dict[str, str]:
    script = tmp_path / "scontrol"
    script.write_text("#!/bin/sh\n"
                      f'[ "$1 $2" = "show hostnames" ] || exit 3\necho "$3" > {tmp_path}/asked\n'
                      + "".join(f"echo {h}\n" for h in hosts))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{tmp_path}:{os.environ['PATH']}"}


def test_slurm_node_list_is_expanded_by_scontrol_and_the_source_left_out(tmp_path, monkeypatch):
    env = fake_scontrol(tmp_path, ["gpu01", "gpu02", "gpu03"])
    monkeypatch.setenv("PATH", env["PATH"])
    c = cfg("relay.source=gpu01")
    hosts = topology.relay_hosts(c, env={"SLURM_JOB_NODELIST": "gpu[01-03]"})
    assert hosts == ["gpu02", "gpu03"]
    assert (tmp_path / "asked").read_text().strip() == "gpu[01-03]"


def test_slurm_step_node_list_wins_over_the_job_node_list(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, ["r1", "r2"])["PATH"])
    topology.relay_hosts(cfg(), env={"SLURM_JOB_NODELIST": "all[1-9]", "SLURM_STEP_NODELIST": "r[1-2]"})
    assert (tmp_path / "asked").read_text().strip() == "r[1-2]"


def test_no_nodes_and_no_slurm_names_the_field():
    with pytest.raises(ConfigError, match=r"relay\.nodes: is empty and no SLURM"):
        topology.relay_hosts(cfg(), env={})


def test_slurm_without_scontrol_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH directory: no scontrol anywhere
    with pytest.raises(ConfigError, match="scontrol"):
        topology.relay_hosts(cfg(), env={"SLURM_JOB_NODELIST": "n[1-2]"})


# ---------------------------------------------------------------- this relay's index


def test_index_from_flag_then_env_then_host_name():
    hosts = ["a.cluster", "b.cluster", "c.cluster"]
    assert topology.own_index(hosts, 2, env={"OFFPOLICY_RELAY_INDEX": "1"}, hostname="a") == 2
    assert topology.own_index(hosts, None, env={"OFFPOLICY_RELAY_INDEX": "1"}, hostname="a") == 1
    assert topology.own_index(hosts, None, env={}, hostname="b") == 1
    assert topology.own_index(hosts, None, env={}, hostname="c.cluster") == 2


@pytest.mark.parametrize("explicit, hostname, match", [(3, "a", "outside relay.nodes"), (None, "zz", "not in the relay")])
def test_bad_index_or_unknown_host_fails_with_the_fix(explicit, hostname, match):
    with pytest.raises(ConfigError, match=match):
        topology.own_index(["a", "b"], explicit, env={}, hostname=hostname)


def test_bind_address_keeps_ips_and_resolves_names():
    assert topology.bind_address("127.0.0.3") == "127.0.0.3"
    assert topology.bind_address("0.0.0.0") == "*"
    assert topology.bind_address("localhost") == "127.0.0.1"


def test_source_defaults_to_the_learner_host(monkeypatch):
    monkeypatch.delenv("OFFPOLICY_LEARNER_HOST", raising=False)
    assert topology.source_host(cfg("transport.learner_host=10.0.0.7")) == "10.0.0.7"
    assert topology.source_host(cfg("relay.source=10.0.0.9")) == "10.0.0.9"


def test_several_learner_nodes_each_have_a_source_that_finds_its_part():
    c = cfg("relay.sources=[gpu01,gpu02]")
    assert topology.source_hosts(c) == ["gpu01", "gpu02"] and topology.source_host(c) == "gpu01"
    assert topology.source_index(c, None, env={}, hostname="gpu02.cluster") == 1
    assert topology.source_index(c, 0, env={}, hostname="elsewhere") == 0
    assert topology.source_index(c, None, env={"OFFPOLICY_RELAY_INDEX": "1"}, hostname="x") == 1
    with pytest.raises(ConfigError, match=r"config field relay.sources: this host 'gpu09' is not in relay.sources .*fix relay.sources"):
        topology.source_index(c, None, env={}, hostname="gpu09")
    one = cfg("relay.sources=[gpu01]")  # one learner node: the source serves the whole store
    assert topology.source_index(one, None, env={}, hostname="anything") is None
    assert topology.source_hosts(cfg("relay.source=gpu07")) == ["gpu07"]


def test_the_slurm_node_list_leaves_every_learner_nodes_source_out(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, ["gpu01", "gpu02", "gpu03", "gpu04"])["PATH"])
    c = cfg("relay.sources=[gpu01,gpu02.cluster]")
    assert topology.relay_hosts(c, env={"SLURM_JOB_NODELIST": "gpu[01-04]"}) == ["gpu03", "gpu04"]
    assert not topology.same_host("10.0.0.1", "10.0.0.2") and topology.same_host("a.x", "a.y")


# ---------------------------------------------------------------- config checks


@pytest.mark.parametrize("override, field", [
    ("relay.port=0", "relay.port"),
    ("relay.announce_port=5570", "relay.announce_port"),
    ("relay.fanout=0", "relay.fanout"),
    ("relay.window=0", "relay.window"),
    ("relay.chunk_bytes=100", "relay.chunk_bytes"),
    ("relay.peer_timeout_s=0", "relay.peer_timeout_s"),
    ("relay.linger_s=-1", "relay.linger_s"),
    ("relay.metrics_port=70000", "relay.metrics_port"),
    ("relay.nodes=[a,a]", "relay.nodes"),
    ("relay.sources=[a,a]", "relay.sources"),
    ("relay.sources=[a,b] relay.source=b", "relay.source"),
    ("relay.sources=[a,b] relay.nodes=[b,c]", "relay.nodes"),
])
def test_check_names_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"config field {field.replace('.', '[.]')}:"):
        topology.check(cfg(*override.split()))


def test_defaults_pass_the_checks():
    topology.check(cfg())


# ---------------------------------------------------------------- the entry point


def relay_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "offpolicy.services.relay", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    return proc, time.perf_counter() - t0


def test_help_is_instant_and_imports_neither_torch_nor_the_relay():
    proc, seconds = relay_cli("--help")
    assert proc.returncode == 0 and "--serve" in proc.stdout and "--index" in proc.stdout
    assert seconds < 1.0
    code = "import sys; from offpolicy.services import relay; import offpolicy.relay.node; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_dry_run_prints_the_relay_section():
    proc, _ = relay_cli("--dry-run", "--config", QUICKSTART, "relay.nodes=[n1,n2]", "relay.window=4")
    assert proc.returncode == 0, proc.stderr
    assert "relay:" in proc.stdout and "window: 4" in proc.stdout and "- n1" in proc.stdout


@pytest.mark.parametrize("args, text", [
    (["relay.fanout=0"], "relay.fanout"),
    (["relay.nodes=[n1]", "--index", "4"], "outside relay.nodes"),
    ([], "relay.nodes: is empty"),
])
def test_config_errors_exit_2_with_the_field(args, text, shm_root, monkeypatch):
    for var in ("SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    proc, _ = relay_cli("--config", QUICKSTART, f"weights.root={shm_root}", *args)
    assert proc.returncode == 2, proc.stderr
    assert text in proc.stderr and "Traceback" not in proc.stderr


def test_a_port_in_use_exits_2_naming_the_field(shm_root):
    with socket.socket() as busy:
        busy.bind(("127.0.0.2", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, _ = relay_cli("--config", QUICKSTART, f"weights.root={shm_root}", "relay.nodes=[127.0.0.2]",
                            f"relay.port={port}", "--index", "0")
    assert proc.returncode == 2, proc.stderr
    assert "config field relay.port: cannot bind 127.0.0.2" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- rollouts on a relay node


def test_rollouts_find_their_nodes_relay_pub_by_bind_host_or_by_their_place_in_the_list(monkeypatch):
    from offpolicy.rollout.daemon import announce_address

    monkeypatch.delenv("OFFPOLICY_RELAY_INDEX", raising=False)
    monkeypatch.delenv("OFFPOLICY_LEARNER_HOST", raising=False)
    port = ["relay.announce_port=6001"]
    assert announce_address(cfg(*port)) == "tcp://127.0.0.1:5556"  # the default: the learner's PUB
    relayed = [*port, "rollout.announce=relay", "relay.nodes=[10.0.0.2,10.0.0.3]"]
    assert announce_address(cfg(*relayed, "relay.bind_host=0.0.0.0")) == "tcp://127.0.0.1:6001"  # binds all
    assert announce_address(cfg(*relayed, "relay.bind_host=10.0.0.9")) == "tcp://10.0.0.9:6001"
    assert topology.local_announce(cfg(*relayed), env={"OFFPOLICY_RELAY_INDEX": "1"}) == "tcp://10.0.0.3:6001"
    assert topology.local_announce(cfg(*relayed), env={}, hostname="10.0.0.2") == "tcp://10.0.0.2:6001"
    with pytest.raises(ConfigError, match="config field rollout.announce: is relay, but this host 'elsewhere'"):
        topology.local_announce(cfg(*relayed), env={}, hostname="elsewhere")


def test_a_rollout_on_a_host_without_a_relay_exits_2_naming_rollout_announce(monkeypatch):
    monkeypatch.delenv("OFFPOLICY_RELAY_INDEX", raising=False)
    out = subprocess.run([sys.executable, "-m", "offpolicy.services.rollout", "--config", QUICKSTART,
                          "rollout.announce=relay", "relay.nodes=[no-such-node-1]"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "config field rollout.announce: is relay" in out.stderr
