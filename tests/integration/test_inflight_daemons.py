"""A learner and a rollout daemon with `rollout.inflight_updates=true` (the torch engine on the CPU, responses of up
to 100 tokens, one group per lease, so that generating a batch takes longer than a learner step: the rollout is
never idle waiting for the staleness gate and versions are announced while it generates; with the learner the
slower side, every generation would begin right after a version and end before the next): generations move to a
newer version between decode steps, and the run keeps its claims: nothing lost or trained twice, the staleness bound held by every token (the oldest token's version within
`max_staleness` of the step, no token from a version the step had not yet made), and every token generated with a
version its rollout had read and swapped in.

(`helpers.check_timeline` is not applied: its claim that no version is read before its announcement does not hold
with the store scan of `weights.subscribe`, which can find a version renamed into place a few milliseconds before the
learner announces it, with or without in-flight updates; every version read here is checked to be published.)"""

from __future__ import annotations

import subprocess

from tests.conftest import QUICKSTART, daemon_cmd
from tests.integration.helpers import check_run_invariants, read_jsonl, stop_all

STEPS = 12
STALENESS = 1


def test_rollouts_switch_versions_in_flight_and_every_token_stays_within_the_bound(run_overrides, tmp_path):
    common = [*run_overrides, f"learner.total_steps={STEPS}", "rollout.inflight_updates=true", "run.trace=true",
              "rollout.max_new_tokens=100",
              "model.arch.max_position_embeddings=128", "rollout.groups_per_lease=1", f"algo.max_staleness={STALENESS}", "checkpoint.final=false"]
    procs: list[subprocess.Popen] = []
    try:
        for name, extra in (("learner", []), ("rollout0", ["--index", "0"])):
            log = open(tmp_path / f"{name}.log", "w")
            module = "learner" if name == "learner" else "rollout"
            procs.append(subprocess.Popen(daemon_cmd(module, "--config", QUICKSTART, *common, *extra),
                                          stdout=log, stderr=subprocess.STDOUT))
        assert procs[0].wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert procs[1].wait(60) == 0, (tmp_path / "rollout0.log").read_text()[-3000:]  # it leaves on the Goodbye
    finally:
        stop_all(procs)
    run_dir = run_overrides.run_dir / "quickstart"
    summary = check_run_invariants(run_dir, max_staleness=STALENESS)  # 0 lost, 0 duplicated, oldest tokens in bound
    assert summary["steps"] == STEPS and summary["groups_dropped_stale"] == 0
    learner = read_jsonl(run_dir / "trace" / "learner.jsonl")
    published = {s["args"]["version"] for s in learner if s["name"] == "publish"}
    assert published == set(range(STEPS + 1))
    # generations did move to newer versions in flight: some trained tokens came from a later version than their
    # response's first
    assert summary["tokens_switched_in_flight"] > 0, summary

    trained = read_jsonl(run_dir / "trained.jsonl")
    for t in trained:  # per token: every version of the group within [step - s, step]
        assert t["step"] - STALENESS <= t["version"] <= t["newest_version"] <= t["step"], t
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        assert 0 <= row["token_staleness_min"] <= row["token_staleness_max"] <= STALENESS, row
        assert 0.0 <= row["switched_token_frac"] <= 1.0

    inflight = 0
    for i in (0,):
        spans = read_jsonl(run_dir / "trace" / f"rollout-{i}.jsonl")
        loads = [s["args"]["version"] for s in sorted(spans, key=lambda s: s["ts"]) if s["name"] == "load"]
        reads = {s["args"]["version"] for s in spans if s["name"] == "prefetch"}
        inflight += sum(1 for s in spans if s["name"] == "load" and s["args"].get("inflight"))
        assert loads == sorted(set(loads)), "versions are swapped in increasing order, each once"
        assert set(loads) <= reads <= published, "every version swapped in was published and read into the spare first"
        generated = [s for s in sorted(spans, key=lambda s: s["ts"]) if s["name"] in ("load", "generate")]
        held = None
        for s in generated:  # each generate call began with the version its rollout swapped in last
            if s["name"] == "load":
                held = s["args"]["version"]
            else:
                assert s["args"]["version"] == held, (s, held)
        mine = [t for t in trained if t["daemon"].startswith(f"rollout-{i}@")]
        # no token trained under a version its rollout did not hold: the oldest and newest of each group were loaded
        assert {v for t in mine for v in (t["version"], t["newest_version"])} <= set(loads), (loads, mine[:3])
    assert inflight > 0
