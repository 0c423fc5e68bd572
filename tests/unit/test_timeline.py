"""The run's timeline: spans written by `plumbing.trace.Tracer`, merged and drawn by `loggers.timeline`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from offpolicy.config import load_config
from offpolicy.loggers import timeline
from offpolicy.plumbing.trace import Tracer, trace_dir
from tests.conftest import QUICKSTART


def test_spans_land_in_the_run_directory_only_when_tracing(tmp_path):
    off = Tracer(load_config(QUICKSTART, [f"run.dir={tmp_path}"]), "learner")
    with off.span("train", step=0):
        pass
    off.flush()
    assert not list(tmp_path.rglob("trace"))
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true"])
    on = Tracer(cfg, "rollout-0")
    with on.span("generate", groups=8):
        time.sleep(0.01)
    t = threading.Thread(target=lambda: on.add("load", time.time(), 0.002, version=3), name="swap")
    t.start()
    t.join()
    on.flush()
    lines = [json.loads(x) for x in (trace_dir(cfg) / "rollout-0.jsonl").read_text().splitlines()]
    assert [(s["name"], s["thread"], s["args"]) for s in lines] == [("generate", "MainThread", {"groups": 8}),
                                                                   ("load", "swap", {"version": 3})]
    assert lines[0]["dur"] >= 10_000 and lines[1]["dur"] == 2000


def test_merge_gives_chrome_trace_events_and_draw_a_picture(tmp_path):
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    for proc in ("rollout-0", "learner"):
        tr = Tracer(cfg, proc)
        for i in range(3):
            tr.add("train" if proc == "learner" else "generate", 1000.0 + i, 0.5, step=i)
        tr.flush()
    (trace_dir(cfg) / "learner.jsonl").open("a").write('{"name": "cut sh')  # a line a kill cut short
    doc = timeline.merge(trace_dir(cfg).parent)
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert names == ["learner", "rollout-0"]  # the learner's lane first
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 6 and {e["dur"] for e in spans} == {500_000} and spans[0]["ts"] == 1_000_000_000
    trace, png = timeline.write(trace_dir(cfg).parent)
    assert json.loads(trace.read_text()) == doc and png.stat().st_size > 5_000
    assert timeline.summary(trace_dir(cfg).parent)["learner"] == {"train": {"count": 3, "seconds": 1.5}}


def test_the_cli_says_what_to_do_without_a_timeline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "trace", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "run.trace=true" in r.stderr
