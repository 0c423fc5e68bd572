"""Helpers for integration tests that start real daemons as subprocesses."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Prometheus text exposition of host:port/metrics as {sample name with labels: value}; ConnectionError
    while nothing answers there (offpolicy.plumbing.metrics.scrape: a self-connect is no answer)."""
    from offpolicy.plumbing.metrics import scrape as scrape_text

    text = scrape_text(port, host)
    if text is None:
        raise ConnectionError(f"nothing answers on http://{host}:{port}/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def cmdline(p) -> str:
    """A psutil process's command line, or "" once it has ended (exited, or a zombie its parent has not reaped)."""
    import psutil

    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - polling a daemon that may not be up yet
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error!r})")


def descendants_until_exit(proc: subprocess.Popen, deadline: float, interval: float = 0.5) -> set[int]:
    """Every process that ran below `proc` (recursively) while `proc` ran, polled every `interval` s until it exits
    or `deadline` (monotonic): what a launcher started, to check afterwards that none of it is left."""
    import psutil

    pids: set[int] = set()
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            pids |= {k.pid for k in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(interval)
    return pids


def still_alive(pids: set[int]) -> list[int]:
    """The pids of `pids` that still run (zombies, ended but not reaped, do not count)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def stop_all(procs: list[subprocess.Popen], timeout: float = 20) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def check_run_invariants(run_dir: Path, max_staleness: int) -> dict:
    """The claims every run must satisfy, checked from its own files; returns summary.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = read_jsonl(run_dir / "trained.jsonl")
    assert summary["prompts_lost"] == 0
    assert summary["prompts_duplicated"] == 0
    assert summary["max_staleness_seen"] <= max_staleness
    keys = [(t["epoch"], t["prompt_id"]) for t in trained]
    assert len(keys) == len(set(keys)), "a prompt was trained twice"
    assert all(0 <= t["step"] - t["version"] <= max_staleness for t in trained), "staleness bound broken"
    assert len(trained) == summary["groups_trained"]
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(summary["steps"])), "versions did not advance one per step"
    return summary


def check_timeline(run_dir: Path, steps: range) -> dict[str, list[dict]]:
    """A traced run's timeline (`run.trace`) holds every process's parts in causal order: the learner's steps back to
    back, each version published after the step that made it and read by a rollout only once announced, each
    generation with the version its rollout loaded last, each group the hub received sent before. Returns the spans."""
    spans = {p.stem: read_jsonl(p) for p in sorted((run_dir / "trace").glob("*.jsonl"))}
    learner = spans.pop("learner")
    assert {s["name"] for s in learner} >= {"wait batch", "train", "publish stall", "publish", "receive"}
    train = [s for s in learner if s["name"] == "train"]
    assert [s["args"]["step"] for s in train] == list(steps)
    publish = {s["args"]["version"]: s for s in learner if s["name"] == "publish"}
    assert sorted(publish) == list(range(steps.start, steps.stop + 1))

    def end(s: dict) -> int:
        return s["ts"] + s["dur"]

    main = sorted((s for s in learner if s["thread"] == "MainThread"), key=lambda s: s["ts"])
    assert all(end(a) <= b["ts"] for a, b in zip(main, main[1:])), "the learner's step parts overlap"
    # the step's spans are laid out from its measured durations, ending when the ledger records the step
    # (ledger._trace), microseconds after the publish thread took its own clock reading at the snapshot: a version
    # published before its step is one that began more than that (100 us seen) ahead of the step's end
    slack_us = 1000
    assert all(publish[s["args"]["step"] + 1]["ts"] + slack_us >= end(s) for s in train), \
        "a version published before its step"
    sent = {}
    for proc, rs in spans.items():
        assert {s["name"] for s in rs} >= {"wait lease", "load", "generate", "score and send"}, proc
        held = None
        for s in sorted(rs, key=lambda s: s["ts"]):
            if s["name"] in ("load", "prefetch"):  # a prefetch: the background read of a version (double buffer)
                v = s["args"]["version"]
                assert end(publish[v]) <= s["ts"], f"{proc} began to {s['name']} version {v} before it was announced"
                held = v if s["name"] == "load" else held
            elif s["name"] == "generate":
                assert s["args"]["version"] == held, f"{proc} generated with version {s['args']['version']}, held {held}"
            elif s["name"] == "score and send":
                sent[s["args"]["lease"]] = s
    for r in (s for s in learner if s["name"] == "receive" and end(s) < train[-1]["ts"]):  # later: a rollout stopped
        for lease in r["args"]["leases"]:                                                  # mid-send writes no span
            assert lease in sent and sent[lease]["ts"] <= end(r), f"groups of lease {lease} received, never sent"
    return {"learner": learner, **spans}
