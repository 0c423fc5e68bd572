"""A learner and two rollout daemons with `rollout.double_buffer=true` (the torch engine on the CPU): every
version is read in the background into the spare weights and swapped in between generate calls, and the
run keeps its claims: nothing lost or trained twice, every group within the staleness bound, and every
trained group generated with a version its rollout had swapped in."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import QUICKSTART, daemon_cmd
from tests.integration.helpers import check_run_invariants, check_timeline, read_jsonl, stop_all

STEPS = 12


def test_double_buffered_rollouts_swap_versions_read_in_the_background(run_overrides, tmp_path):
    common = [*run_overrides, f"learner.total_steps={STEPS}", "rollout.double_buffer=true", "run.trace=true",
              "checkpoint.final=false"]
    procs: list[subprocess.Popen] = []
    try:
        for name, extra in (("learner", []), ("rollout0", ["--index", "0"]), ("rollout1", ["--index", "1"])):
            log = open(tmp_path / f"{name}.log", "w")
            module = "learner" if name == "learner" else "rollout"
            procs.append(subprocess.Popen(daemon_cmd(module, "--config", QUICKSTART, *common, *extra),
                                          stdout=log, stderr=subprocess.STDOUT))
        assert procs[0].wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for p, name in zip(procs[1:], ("rollout0", "rollout1")):  # they leave on the learner's Goodbye
            assert p.wait(60) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        stop_all(procs)
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, max_staleness=1)  # 0 lost, 0 duplicated, staleness bound held
    assert summary["steps"] == STEPS
    check_timeline(run_dir, range(STEPS))  # no version read before its announcement, none generated with unswapped

    loaded: set[int] = set()
    for i in (0, 1):
        spans = read_jsonl(run_dir / "trace" / f"rollout-{i}.jsonl")
        loads = [s["args"]["version"] for s in spans if s["name"] == "load"]
        reads = [s["args"]["version"] for s in spans if s["name"] == "prefetch"]
        log = (tmp_path / f"rollout{i}.log").read_text()
        assert loads, log[-3000:]
        # every swap took a version the background thread had read into the spare weights, one read per swap
        assert reads == loads, (reads, loads)
        assert loads == sorted(set(loads)), "versions are swapped in increasing order, each once"
        assert "read in the background in" in log and "failed to read" not in log
        loaded |= set(loads)
    trained = read_jsonl(run_dir / "trained.jsonl")
    # no token trained under a version its rollout did not hold: each group's version was swapped in
    assert {t["version"] for t in trained} <= loaded, json.dumps(sorted(loaded))
