"""The real daemons with rollout.engine=sglang in http mode, against a stand-in SGLang server; and in engine mode,
against a stand-in `sglang` whose scheduler process dies.

The stand-in server (tests/sglang_fake.py) speaks SGLang's /generate, /pause_generation,
/update_weights_from_disk, ... shapes and generates with the quickstart's tiny model through the
embedded torch engine, loading every weight version from the store path the rollout daemon sends.
So the rewards and behaviour logprobs the learner trains on are real, and the learner's own logprobs
must match them for a version-0 batch. The stand-in `sglang` (tests/sglang_inprocess.py) runs a real scheduler
process and signals its death as sglang 0.5.14 does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import QUICKSTART, ROOT, daemon_cmd, free_ports
from tests.integration.helpers import check_run_invariants, read_jsonl, scrape, stop_all, wait_for
from tests.sglang_fake import FakeSGLang
from tests.sglang_fake_server import TorchSGLang

STEPS = 12
PROVEN = 'offpolicy_weight_loads_total{method="disk",proven="true"}'


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the stand-in shares 2 cores with the learner and the rollout daemon
    yield
    torch.set_num_threads(before)


def test_learner_and_an_sglang_rollout_train_through_the_http_engine(run_overrides, tmp_path, one_thread):
    model = TorchSGLang(list(run_overrides))
    fake = FakeSGLang(sampler=model.sample, on_update=model.update)
    fake.abort_rows = 3  # SGLang aborts three rows: generated again, counted, never trained on
    sglang = ["rollout.engine=sglang", "rollout.sglang.mode=http", f"rollout.sglang.urls=[{fake.url}]",
              "rollout.sglang.startup_timeout_s=30"]
    rport, = free_ports(1)
    procs = []
    try:
        for module, extra, name in [("learner", [f"learner.total_steps={STEPS}"], "learner"),
                                    ("rollout", ["--index", "0", f"metrics.port={rport}"], "rollout0")]:
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen(daemon_cmd(module, "--config", QUICKSTART, *run_overrides, *sglang, *extra),
                                          stdout=log, stderr=subprocess.STDOUT))
        wait_for(lambda: scrape(rport).get("offpolicy_rollout_samples_aborted_total", 0) == 3, 60,
                 "the rollout to count the three aborted samples")
        # each version proven by SGLang's read-back (the stand-in answers get_weights_by_name from its files)
        wait_for(lambda: scrape(rport).get(PROVEN, 0) >= 3, 60, "three loads proven by read-back")
        assert scrape(rport).get(PROVEN.replace('"true"', '"false"'), 0) == 0
        # each prompt's samples are rows of their own: the first computed, the rest held by the prefix cache
        said = scrape(rport)
        computed = said.get('offpolicy_rollout_prompt_tokens_total{kind="computed"}', 0)
        assert computed > 0 and said.get('offpolicy_rollout_prompt_tokens_total{kind="cached"}', 0) > computed, said
        assert procs[0].wait(90) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert procs[1].wait(60) == 0, (tmp_path / "rollout0.log").read_text()[-3000:]
    finally:
        stop_all(procs)
        fake.stop()
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == STEPS
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[0]["staleness_max"] == 0 and metrics[0]["logprob_diff_max"] < 1e-4  # SGLang's logprobs are real
    # every version went through pause -> update_weights_from_disk -> continue, tagged with its number
    updates = [body for _, path, body in fake.calls if path == "/update_weights_from_disk"]
    versions = [int(u["weight_version"]) for u in updates]
    assert versions == sorted(set(versions)) and versions[0] == 0 and versions[-1] >= STEPS - 2
    assert [u["model_path"] for u in updates] == model.loaded
    paths = fake.paths()
    for i, p in enumerate(paths):
        if p == "/update_weights_from_disk":
            assert paths[i - 1] == "/pause_generation" and paths[i + 1] == "/continue_generation"
    assert "Traceback" not in (tmp_path / "rollout0.log").read_text()
    assert len(set(map(str, [b["name"] for _, p, b in fake.calls if p == "/get_weights_by_name"]))) == 9


def test_sglang_servers_switch_versions_in_flight_and_every_token_stays_within_the_bound(run_overrides, tmp_path,
                                                                                          one_thread):
    """rollout.inflight_updates=true with an SGLang server over HTTP: the stand-in streams a token every few ms (token
    mode, the real model's tokens and logprobs) and an update with abort_all_requests ends its running requests, so
    versions the learner announces while a lease generates are switched to midway and its samples go on as
    continuations. The run keeps its claims: nothing lost or trained twice, every token within the staleness bound."""
    long = ["model.arch.max_position_embeddings=128", "rollout.max_new_tokens=100", "rollout.groups_per_lease=1",
            "algo.max_staleness=1", "checkpoint.final=false"]
    model = TorchSGLang([*run_overrides, *long])
    fake = FakeSGLang(sampler=model.sample, on_update=model.update)
    fake.token_s, fake.mark_versions = 0.004, False  # a lease ~0.4 s: longer than a learner step
    sglang = ["rollout.engine=sglang", "rollout.sglang.mode=http", f"rollout.sglang.urls=[{fake.url}]",
              "rollout.sglang.startup_timeout_s=30", "rollout.inflight_updates=true", *long]
    procs = []
    try:
        for module, extra, name in [("learner", [f"learner.total_steps={STEPS}"], "learner"),
                                    ("rollout", ["--index", "0"], "rollout0")]:
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen(daemon_cmd(module, "--config", QUICKSTART, *run_overrides, *sglang, *extra),
                                          stdout=log, stderr=subprocess.STDOUT))
        assert procs[0].wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert procs[1].wait(60) == 0, (tmp_path / "rollout0.log").read_text()[-3000:]
    finally:
        stop_all(procs)
        fake.stop()
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)  # 0 lost, 0 duplicated, in bound
    assert summary["steps"] == STEPS and summary["groups_dropped_stale"] == 0
    assert summary["tokens_switched_in_flight"] > 0, summary  # some samples went on under a newer version
    for t in read_jsonl(run_overrides.run_dir / "quickstart" / "trained.jsonl"):
        assert t["step"] - 1 <= t["version"] <= t["newest_version"] <= t["step"], t
    switches = [b for _, p, b in fake.calls if p == "/update_weights_from_disk" and b.get("abort_all_requests")]
    assert switches  # rollout.sglang.inflight_switch abort_all, the default: no pause around a switch
    log = (tmp_path / "rollout0.log").read_text()
    assert "switched in flight to weight version" in log and "Traceback" not in log


def test_an_in_process_sglang_whose_scheduler_dies_ends_the_rollout_with_code_1_and_loses_no_prompt(run_overrides,
                                                                                                     tmp_path):
    """rollout.sglang.mode=engine; the stand-in scheduler is SIGKILLed while it generates. SGLang's watchdog sends the
    daemon SIGQUIT, whose handler (SGLang's) would SIGKILL the daemon: ours takes it, so the daemon says why, its
    generate in flight fails, and it stops through its own shutdown (SGLang's engine shut down at exit) with exit code
    1. Started again, as its supervisor does, it takes its place at the hub, which gives the dead daemon's leased
    prompts to others: the run finishes with every prompt trained once."""
    model, standin = tmp_path / "model", tmp_path / "standin"
    model.mkdir()
    standin.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 13}))  # the stand-in's
    rollout = [sys.executable, "-m", "tests.sglang_inprocess", "--config", QUICKSTART, *run_overrides, "--index", "0",
               "rollout.engine=sglang", "rollout.sglang.mode=engine", f"model.path={model}"]
    procs = []
    try:
        learner_log = open(tmp_path / "learner.log", "w")
        procs.append(subprocess.Popen(daemon_cmd("learner", "--config", QUICKSTART, *run_overrides,
                                                 f"learner.total_steps={STEPS}"),
                                      stdout=learner_log, stderr=subprocess.STDOUT))
        plan = {"hang_at": 5, "dir": str(standin)}  # its 5th generate (a lease) never ends: the kill lands mid-generate
        first = subprocess.Popen(rollout, stdout=open(tmp_path / "rollout0.log", "w"), stderr=subprocess.STDOUT,
                                 env={**os.environ, "SGLANG_STANDIN": json.dumps(plan)})
        procs.append(first)
        wait_for(lambda: (standin / "generates").read_text() == "5", 120, "the stand-in scheduler's 5th generate")
        scheduler = int((standin / "scheduler.pid").read_text())
        os.kill(scheduler, signal.SIGKILL)
        code = first.wait(60)
        log = (tmp_path / "rollout0.log").read_text()
        assert code == 1, f"exit code {code}:\n{log[-3000:]}"
        assert (f"SGLang's scheduler process exited (sglang::scheduler_TP0 (pid {scheduler}) was killed by SIGKILL): "
                "the in-process engine is gone; the rollout daemon exits so that its supervisor restarts it; see the "
                "daemon's log above for SGLang's traceback") in log, log[-3000:]
        assert "rollout daemon 0 stops with exit code 1: its engine is lost" in log
        assert "Received sigquit from a child process" not in log  # SGLang's handler never ran
        assert "stand-in sglang.Engine: shut down" in log  # the daemon's own exit ran the atexit handlers
        second = subprocess.Popen(rollout, stdout=open(tmp_path / "rollout0-again.log", "w"), stderr=subprocess.STDOUT)
        procs.append(second)
        assert procs[0].wait(180) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert second.wait(60) == 0, (tmp_path / "rollout0-again.log").read_text()[-3000:]
    finally:
        stop_all(procs)
    taken = re.findall(r"took the place of \S+ \(slot rollout-0@\S+\): its (\d+) leased prompts go to others now",
                       (tmp_path / "learner.log").read_text())
    assert len(taken) == 1 and int(taken[0]) >= 1, taken  # the lease the dead daemon held went back at once
    summary = check_run_invariants(run_overrides.run_dir / "quickstart", 1)  # no prompt lost or trained twice
    assert summary["steps"] == STEPS and summary["leases_expired"] >= 1


@pytest.mark.slow  # ~3 min on 2 busy cores: two servers and two daemons (the unit tests check the commands)
def test_offpolicy_run_launches_an_sglang_server_per_rollout_and_brings_a_killed_one_back(run_overrides, tmp_path):
    """`offpolicy run` with rollout.sglang.mode=http and no urls launches one server per rollout daemon (here the
    stand-in, through rollout.sglang.launch, in token mode so that versions are switched in flight by
    inflight_switch=abort_all), each on its own port, started from the run's initial model with the flags SGLang's
    parser takes; a chaos drill SIGKILLs a server, the launcher starts it again and its daemon brings it to the
    current version while it waits for it (rollout.sglang.recover_timeout_s: the daemon does not fail). The run finishes
    with nothing lost or trained twice and no server left running."""
    import psutil

    from offpolicy.plumbing.ports import free_block

    port = free_block(2)  # below the ephemeral range, so the +10000 SGLang 0.5.14 takes for gRPC stays a port
    long = ["model.arch.max_position_embeddings=128", "rollout.max_new_tokens=40", "rollout.groups_per_lease=1",
            "checkpoint.final=false"]
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", str(QUICKSTART), *run_overrides, *long,
           "run.rollouts=2", "learner.total_steps=16", "rollout.engine=sglang", "rollout.sglang.mode=http",
           f"rollout.sglang.server_port={port}",
           f"rollout.sglang.launch=[{sys.executable}, -m, tests.sglang_fake_server]",
           "rollout.sglang.startup_timeout_s=120", "rollout.sglang.health_check_interval_s=1",
           "rollout.inflight_updates=true", "rollout.sglang.inflight_switch=abort_all", "run.chaos.every_s=4",
           "run.chaos.targets=[sglang]", "run.chaos.max_kills=1", "run.chaos.after_steps=4",
           "run.supervise.kill_grace_s=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OFFPOLICY_FAKE_SGLANG_TOKEN_S": "0.004",
           "OFFPOLICY_FAKE_SGLANG_IGNORE_SIGTERM": "1",  # as SGLang's servers, which the stop then SIGKILLs
           "OFFPOLICY_FAKE_SGLANG_OVERRIDES": json.dumps([*run_overrides, *long])}
    out = tmp_path / "launcher.out"
    with open(out, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
    text = out.read_text()
    run_dir = run_overrides.run_dir / "quickstart"
    assert code == 0, text[-4000:]
    assert "+ 2 SGLang servers" in text and re.search(r"sglang-\d restarted \(pid \d+", text), text[-4000:]
    assert "SIGKILL to sglang-" in text, text[-2000:]  # the stop's
    assert "was killed by SIGKILL; its log" not in text, text[-4000:]  # ... told to go, not a failure to report
    assert not re.search(r"rollout-\d \(pid \d+\) exited", text), text[-4000:]  # it waited for its server
    assert "waiting up to rollout.sglang.recover_timeout_s" in "".join(
        (run_dir / "logs" / f"rollout-{i}.log").read_text() for i in (0, 1))
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == 16 and summary["chaos_kills"] == 1
    for i in (0, 1):  # each server on its own port, from the initial model, with SGLang's flags
        log = (run_dir / "logs" / f"sglang-{i}.log").read_text()
        assert f"at http://127.0.0.1:{port + i}: model {run_dir / 'sglang-initial-model'}, seed {i}" in log, log
        assert "ignored []" in log and "offpolicy_fingerprint" in log
    rollouts = "".join((run_dir / "logs" / f"rollout-{i}.log").read_text() for i in (0, 1))
    assert "switched in flight to weight version" in rollouts and "update with abort_all_requests" in rollouts
    assert not [p for p in psutil.process_iter(["cmdline"]) if "tests.sglang_fake_server" in
                " ".join(p.info["cmdline"] or []) and f"--port {port}" in " ".join(p.info["cmdline"] or [])]
