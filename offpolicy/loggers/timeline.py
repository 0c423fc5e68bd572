"""`offpolicy trace RUN_DIR`: the run's timeline (`run.trace`, offpolicy/plumbing/trace.py) as a file Perfetto opens
and a picture.

`merge(run_dir)` reads every `trace/<process>.jsonl` and returns Chrome's trace event format (`{"traceEvents":
[...]}`: one complete event `ph: X` per span, a process per file, a thread per writer thread, process and thread
names as metadata events), which `write` saves as `<run dir>/trace.json` (https://ui.perfetto.dev or
chrome://tracing open it). `draw` makes `<run dir>/timeline.png`: a lane per process (learner first), a bar per
span colored by its name, time in seconds from the first span; `last_s` keeps only the newest seconds (a long
run's bars are too thin to see otherwise). `summary` gives per process and span name the count and seconds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def read(run_dir: Path) -> dict[str, list[dict]]:
    """Process name -> its spans (a line cut short by a kill is skipped)."""
    out = {}
    for f in sorted((Path(run_dir) / "trace").glob("*.jsonl")):
        spans = []
        for line in f.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        out[f.stem] = spans
    if not out:
        raise FileNotFoundError(f"{run_dir}/trace/ holds no timeline: run with run.trace=true")
    return out


def _order(name: str) -> tuple:
    return (not name.startswith("learner"), name)


def merge(run_dir: Path) -> dict:
    events = []
    for pid, (proc, spans) in enumerate(sorted(read(run_dir).items(), key=lambda kv: _order(kv[0])), start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": proc}})
        tids: dict[str, int] = {}
        for s in spans:
            tid = tids.setdefault(s.get("thread", "main"), len(tids) + 1)
            events.append({"name": s["name"], "ph": "X", "ts": s["ts"], "dur": s["dur"], "pid": pid, "tid": tid,
                           "args": s.get("args", {})})
        for thread, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def summary(run_dir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Process -> span name -> {count, seconds}."""
    out: dict = {}
    for proc, spans in read(run_dir).items():
        parts: dict = defaultdict(lambda: {"count": 0, "seconds": 0.0})
        for s in spans:
            parts[s["name"]]["count"] += 1
            parts[s["name"]]["seconds"] += s["dur"] / 1e6
        out[proc] = {k: {"count": v["count"], "seconds": round(v["seconds"], 3)} for k, v in parts.items()}
    return out


def draw(run_dir: Path, out: Path, last_s: float = 0.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = sorted(read(run_dir).items(), key=lambda kv: _order(kv[0]))
    t0 = min(s["ts"] for _, spans in procs for s in spans) / 1e6
    end = max((s["ts"] + s["dur"]) / 1e6 for _, spans in procs for s in spans) - t0
    lo = max(0.0, end - last_s) if last_s else 0.0
    names = sorted({s["name"] for _, spans in procs for s in spans})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(procs) + 1.5))
    for lane, (proc, spans) in enumerate(procs):
        for name in names:
            bars = [((s["ts"] / 1e6 - t0), s["dur"] / 1e6) for s in spans if s["name"] == name
                    and s["ts"] / 1e6 - t0 + s["dur"] / 1e6 >= lo]
            if bars:
                ax.broken_barh(bars, (lane - 0.4, 0.8), color=colors[name], label=name)
    handles = {}
    for h, label in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(label, h)
    ax.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(procs)), [p for p, _ in procs])
    ax.invert_yaxis()
    ax.set_xlim(lo, end)
    ax.set_xlabel("seconds from the first span")
    ax.set_title(f"{Path(run_dir).name}: where each process spends its time")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write(run_dir: Path, last_s: float = 0.0) -> tuple[Path, Path]:
    run_dir = Path(run_dir)
    trace = run_dir / "trace.json"
    trace.write_text(json.dumps(merge(run_dir)))
    return trace, draw(run_dir, run_dir / "timeline.png", last_s)
