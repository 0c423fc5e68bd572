"""Tests for offpolicy.bench.servers (vLLM servers the pipeline bench starts once for all its runs) and the
launcher's `servers`: a run given servers starts none of its own and gives each rollout daemon its server; the
servers' process groups end at the bench's end, children too."""

from __future__ import annotations

import subprocess
import sys
import time

from offpolicy.bench.servers import shared_servers, stop
from offpolicy.config import load_config
from offpolicy.launch import run as launcher_mod
from tests.polling import poll

VLLM_HTTP = ["model.arch.model_type=llama", "rollout.engine=vllm", "rollout.vllm.mode=http", "run.rollouts=2"]


def test_a_run_given_servers_starts_none_and_gives_each_rollout_daemon_its_own(tmp_path, monkeypatch):
    spawned = []

    class FakePopen:
        def __init__(self, cmd, env=None, **kw):
            if "offpolicy.launch.reaper" not in cmd:
                spawned.append(cmd)
            self.returncode, self.pid, self.stdin = 0, 4711, None

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    overrides = [*VLLM_HTTP, f"run.dir={tmp_path}"]
    urls = ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    launcher = launcher_mod.Launcher(None, overrides, load_config(None, overrides), servers=urls)
    launcher.start()
    assert list(launcher.procs) == ["learner", "rollout-0", "rollout-1"]  # no vllm-<i> of its own
    assert [c[-1] for c in spawned[1:]] == [f"rollout.vllm.urls=[{u}]" for u in urls]
    assert not (launcher.dir / "vllm-initial-model").exists()  # nothing built for servers it does not start


def test_only_runs_that_would_launch_vllm_servers_share_them(tmp_path):
    for overrides, share in ((["model.arch.model_type=llama"], True),  # the torch engine: no servers
                             ([*VLLM_HTTP, "rollout.vllm.urls=[http://127.0.0.1:1]"], True),  # the user's servers
                             (VLLM_HTTP, False)):  # --fresh-servers
        with shared_servers(overrides, tmp_path, share) as servers:
            assert servers is None
    assert not (tmp_path / "shared-vllm").exists()


def test_stop_ends_each_servers_whole_process_group():
    """A server's EngineCore is its child in its process group: it goes too, even when the parent went first."""
    child_of = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
               "print(c.pid, flush=True); time.sleep(600)"
    procs = [subprocess.Popen([sys.executable, "-c", child_of], stdout=subprocess.PIPE, start_new_session=True)
             for _ in range(2)]
    children = [int(p.stdout.readline()) for p in procs]  # each server's child, started
    stop(procs, time.time())
    assert all(p.returncode is not None for p in procs)
    poll(lambda: not any(_running(pid) for pid in children), 30.0)  # killed (a zombie until its reaper waits)


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
