"""`offpolicy trace RUN_DIR`: the run's timeline (`run.trace`, offpolicy/plumbing/trace.py) as a file Perfetto opens
and a picture.

`read(run_dir)` gives each process's spans (`trace/<process>.jsonl`); the rest are pure functions of them.
`events(procs)` is Chrome's trace event format (`{"traceEvents": [...]}`: one complete event `ph: X` per span, a
process per file, a thread per writer thread or lane with a tid unique in the trace, process and thread names and
their order as metadata events), which `write` saves as `<run dir>/trace.json` (https://ui.perfetto.dev or
chrome://tracing open it). Perfetto draws a thread's spans only where they nest, so a span that overlaps another of
its thread without nesting in it goes to a second track of that thread (`tracks`). Flow arrows link what caused what
across processes (`links`): each version's `publish` to every rollout's `load` (and `prefetch`) of it, and each
lease's `score and send` to the hub's `receive` batches that took its groups. `lags` measures those links: announce
to load (from a version's announcement to a rollout's load of it starting) and send to receive (from a lease's last
group sent to the hub having taken it). `summary` gives per process and span name the count and seconds,
`prefill` what a rollout's generate calls computed in prefill against their seconds (the prefix cache's part in
their spread),
`publish_beside_train` a learner's publishes that ran beside a train step against those that did not,
`generate_beside_prefetch` a rollout's generate calls beside its background staging against the others,
`prefetch_cpu` the CPU time of that staging against its wall time, `report` the
lines `offpolicy trace` prints. `draw` makes `<run dir>/timeline.png`: a row per process and track (learner
first), a bar per span colored by its name, time in seconds from the first span; `last_s` keeps only the newest
seconds (a long run's bars are too thin to see otherwise).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

MAIN = "MainThread"


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


def _end(s: dict) -> int:
    return s["ts"] + s["dur"]


def tracks(spans: list[dict]) -> list[list[dict]]:
    """One thread's spans on as few tracks as keep every track's spans nested (or apart), in time order. A span that
    begins less than the clocks' drift (`_drift`) before an open span of the track ends, and ends after it, follows
    it instead (its start moved to that end): a span timed in another process (a server's report) starts on that
    process's wall clock, and traces written before `plumbing.trace.now()` took their starts from the wall clock and
    their lengths from perf_counter, so the next span of a thread can seem to begin a few microseconds before the
    last one ended."""
    out: list[tuple[list[dict], list[tuple[int, int]]]] = []  # each track: its spans, its open spans' (end, length)
    for s in sorted(spans, key=lambda s: (s["ts"], -s["dur"])):
        for placed, open_spans in out:
            while open_spans and open_spans[-1][0] <= s["ts"]:
                open_spans.pop()
            fitted, still = _after_drift(s, open_spans)
            if not still or _end(fitted) <= still[-1][0]:
                placed.append(fitted)
                open_spans[:] = [*still, (_end(fitted), fitted["dur"])]
                break
        else:
            out.append(([s], [(_end(s), s["dur"])]))
    return [placed for placed, _ in out]


def _drift(length: int) -> int:
    """Microseconds the wall clock may fall behind perf_counter over a span of `length`: 0.1 %, plus rounding."""
    return 2 + length // 1000


def _after_drift(s: dict, open_spans: list[tuple[int, int]]) -> tuple[dict, list[tuple[int, int]]]:
    """`s` and the track's open spans once those that end within their drift after `s` begins (and before it ends)
    are closed, `s` then starting at the last such end."""
    still = list(open_spans)
    while still and still[-1][0] - s["ts"] <= _drift(still[-1][1]) and _end(s) > still[-1][0]:
        end, _ = still.pop()
        s = {**s, "ts": end, "dur": max(1, _end(s) - end)}
    return s, still


def rows(procs: dict[str, list[dict]]) -> list[tuple[str, str, list[dict]]]:
    """(process, track name, spans) per track: learner first, each process's main thread first."""
    out = []
    for proc, spans in sorted(procs.items(), key=lambda kv: _order(kv[0])):
        threads: dict[str, list[dict]] = defaultdict(list)
        for s in spans:
            threads[s.get("thread", MAIN)].append(s)
        for thread in sorted(threads, key=lambda t: (t != MAIN, t)):
            for i, track in enumerate(tracks(threads[thread])):
                out.append((proc, thread if i == 0 else f"{thread} ({i + 1})", track))
    return out


def links(procs: dict[str, list[dict]]) -> Iterator[tuple[str, tuple[str, dict], tuple[str, dict]]]:
    """(kind, (process, span), (process, span)) for each cause and effect across processes: `announce` from a
    version's publish to a load or prefetch of it, `groups` from a lease's score and send to a receive that took
    some of its groups."""
    published = {s["args"].get("version"): (p, s) for p, spans in procs.items() for s in spans if s["name"] == "publish"}
    sent = {s["args"].get("lease"): (p, s) for p, spans in procs.items() for s in spans if s["name"] == "score and send"}
    for proc, spans in sorted(procs.items(), key=lambda kv: _order(kv[0])):
        for s in sorted(spans, key=lambda s: s["ts"]):
            if s["name"] in ("load", "prefetch") and s["args"].get("version") in published:
                yield "announce", published[s["args"]["version"]], (proc, s)
            elif s["name"] == "receive":
                for lease in s["args"].get("leases", []):
                    if lease in sent:
                        yield "groups", sent[lease], (proc, s)


def lags(procs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Seconds per link: `announce to load` (a version announced to a rollout's load of it starting; a version
    read in the background counts from its prefetch), `send to receive` (a lease's last group sent to the hub
    having taken its groups)."""
    out: dict[str, list[float]] = {"announce to load": [], "send to receive": []}
    received: dict[int, tuple[dict, int]] = {}  # id of a score and send span -> (it, the end of its last receive)
    for kind, (_, src), (_, dst) in links(procs):
        if kind == "announce":
            out["announce to load"].append((dst["ts"] - _end(src)) / 1e6)
        else:
            received[id(src)] = (src, max(_end(dst), received.get(id(src), (src, 0))[1]))
    out["send to receive"] = [max(0, last - _end(src)) / 1e6 for src, last in received.values()]
    return out


def events(procs: dict[str, list[dict]]) -> dict:
    """Chrome's trace event format of the processes' spans, with flow arrows for `links`."""
    out: list[dict] = []
    where: dict[int, tuple[int, int]] = {}  # id of a span -> its (pid, tid)
    pids: dict[str, int] = {}
    for tid, (proc, track, spans) in enumerate(rows(procs), start=1):  # tids unique across processes, as Perfetto
        if proc not in pids:                                            # keys threads by tid
            pids[proc] = len(pids) + 1
            out.append({"name": "process_name", "ph": "M", "pid": pids[proc], "args": {"name": proc}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": pids[proc], "args": {"sort_index": pids[proc]}})
        pid = pids[proc]
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for s in spans:
            where[id(s)] = (pid, tid)
            out.append({"name": s["name"], "ph": "X", "ts": s["ts"], "dur": s["dur"], "pid": pid, "tid": tid,
                        "args": s.get("args", {})})
    for n, (kind, (_, src), (_, dst)) in enumerate(links(procs), start=1):
        for ph, s in (("s", src), ("f", dst)):  # bound to the span around each end's mid-point
            pid, tid = where[id(s)]
            out.append({"name": kind, "cat": kind, "ph": ph, "id": n, "ts": s["ts"] + s["dur"] // 2, "pid": pid,
                        "tid": tid, **({"bp": "e"} if ph == "f" else {})})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def merge(run_dir: Path) -> dict:
    return events(read(run_dir))


def summary(run_dir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Process -> span name -> {count, seconds, shortest, longest} (seconds)."""
    out: dict = {}
    for proc, spans in read(run_dir).items():
        parts: dict[str, list[float]] = defaultdict(list)
        for s in spans:
            parts[s["name"]].append(s["dur"] / 1e6)
        out[proc] = {k: {"count": len(v), "seconds": round(sum(v), 3), "shortest": round(min(v), 6),
                         "longest": round(max(v), 6)} for k, v in parts.items()}
    return out


def _said(name: str, v: dict) -> str:
    out = f"{name} {v['seconds']:.2f} s ({v['count']} x {1e3 * v['seconds'] / v['count']:.1f} ms"
    if v["count"] > 1:  # the spread: one workload's generate calls vary widely within a run (docs/benchmarks.md)
        out += f", {1e3 * v['shortest']:.1f}-{1e3 * v['longest']:.1f}"
    return out + ")"


def prefill(spans: list[dict]) -> dict | None:
    """A process's `generate` calls against what each computed in prefill (its args `prefill_computed`,
    `prefill_cached`, where the engine reports them): the calls, the fewest and most tokens computed, the mean share
    the prefix cache held, and the correlation of seconds with tokens computed (None where every call computed the
    same); None where no call says."""
    calls = [(s["dur"] / 1e6, s["args"]["prefill_computed"], s["args"]["prefill_cached"]) for s in spans
             if s["name"] == "generate" and "prefill_computed" in s.get("args", {})]
    if not calls:
        return None
    seconds, computed, cached = zip(*calls)
    held = [c / (c + k) for k, c in zip(computed, cached) if c + k]
    r = statistics.correlation(seconds, computed) if len(calls) > 2 and len(set(computed)) > 1 \
        and len(set(seconds)) > 1 else None
    return {"calls": len(calls), "fewest": min(computed), "most": max(computed),
            "cached_share": sum(held) / len(held) if held else 0.0, "r": r}


def _spread(seconds: list[float]) -> str:
    ms = sorted(1e3 * x for x in seconds)
    return f"{statistics.median(ms):.1f} ms ({len(ms)} x, {ms[0]:.1f}-{ms[-1]:.1f})"


def _prefill_said(proc: str, v: dict) -> str:
    said = (f"{proc}: generate's prefill computed {v['fewest']:,}-{v['most']:,} prompt tokens a call ({v['calls']} "
            f"calls), the prefix cache held {v['cached_share']:.0%} of them")
    return said + (f"; seconds against tokens computed: r = {v['r']:.2f}" if v["r"] is not None else "")


def publish_beside_train(spans: list[dict]) -> dict | None:
    """A learner's `publish` spans split by whether most of each ran beside a `train` span of the same process (its
    copies then share the GPU with the step) or while the learner waited: {"beside": [seconds...], "alone":
    [seconds...]}, steady versions only: left out are those written into files made new (`fresh_files`: the pages
    they fault in) or through pinned buffers rather than registered maps (`staged_files`: a file met for the first
    time), slower beside a step or not. None unless both kinds are there to compare. With `publish_gap_mib` 0 a
    steady version took as long beside a step as alone; the slow publishes once counted "beside a step" were
    versions met for the first time, which the spans did not yet say (measured: docs/benchmarks.md, "Publishes
    beside a train step")."""
    return _beside(spans, "publish", "train",
                   lambda args: not (args.get("fresh_files") or args.get("staged_files")))


def generate_beside_prefetch(spans: list[dict]) -> dict | None:
    """A rollout's `generate` calls split by whether most of each ran beside a `prefetch` of the same process (the
    next version staged or hashed in the background, where the engine runs it: inside a vLLM server's worker, in the
    daemon for SGLang in process) or not: {"beside": [seconds...], "alone": [seconds...]}; None unless both kinds are
    there. vLLM's generate calls spread far wider than SGLang's on the same workload (docs/benchmarks.md): this
    tells whether the staging beside them is why."""
    return _beside(spans, "generate", "prefetch")


def prefetch_cpu(spans: list[dict]) -> tuple[float, float] | None:
    """The CPU seconds the background staging's threads took (`cpu_seconds` of the `prefetch` spans that carry it:
    vLLM's workers, SGLang's daemon, the torch engine's reader) and those spans' wall seconds; None where none
    carries it. A share near 1 means the staging held a core, and Python's GIL, beside the engine's own threads for
    its whole read; near 0, that it waited on I/O and the GPU."""
    timed = [s for s in spans if s["name"] == "prefetch" and "cpu_seconds" in s.get("args", {})]
    if not timed:
        return None
    return sum(float(s["args"]["cpu_seconds"]) for s in timed), sum(s["dur"] for s in timed) / 1e6


def _beside(spans: list[dict], name: str, other: str, keep=lambda args: True) -> dict | None:
    """`name` spans (of positive length, whose args `keep` takes) split by whether most of each overlaps `other`
    spans: {"beside": [seconds...], "alone": [seconds...]}, or None unless both kinds are there."""
    others = [(s["ts"], _end(s)) for s in spans if s["name"] == other]
    out: dict[str, list[float]] = {"beside": [], "alone": []}
    for s in spans:
        if s["name"] != name or s["dur"] <= 0 or not keep(s.get("args", {})):
            continue
        shared = sum(max(0, min(_end(s), b) - max(s["ts"], a)) for a, b in others)
        out["beside" if shared > s["dur"] / 2 else "alone"].append(s["dur"] / 1e6)
    return out if out["beside"] and out["alone"] else None


def report(run_dir: Path) -> list[str]:
    """Per process its seconds per kind of span (count, mean, shortest-longest), what its generate calls computed in
    prefill (`prefill`), a learner's publishes beside its train steps and apart (`publish_beside_train`), then the
    median and worst lag of each link."""
    lines = []
    procs = read(run_dir)
    for proc, parts in sorted(summary(run_dir).items(), key=lambda kv: _order(kv[0])):
        lines.append(f"{proc}: " + ", ".join(_said(name, v) for name, v in parts.items()))
        if (said := prefill(procs[proc])) is not None:
            lines.append(_prefill_said(proc, said))
        if (split := publish_beside_train(procs[proc])) is not None:
            lines.append(f"{proc}: publish beside a train step {_spread(split['beside'])}, while the learner waited "
                         f"{_spread(split['alone'])} (steady versions: pooled files, registered maps)")
        if (split := generate_beside_prefetch(procs[proc])) is not None:
            lines.append(f"{proc}: generate beside a prefetch {_spread(split['beside'])}, without one "
                         f"{_spread(split['alone'])}")
        if (cpu := prefetch_cpu(procs[proc])) is not None:
            lines.append(f"{proc}: prefetch on the CPU {cpu[0]:.2f} s of its {cpu[1]:.2f} s "
                         f"({100 * cpu[0] / max(cpu[1], 1e-9):.0f} %)")
    for name, seconds in lags(procs).items():
        if seconds:
            lines.append(f"{name}: median {1e3 * statistics.median(seconds):.1f} ms, max {1e3 * max(seconds):.1f} ms "
                         f"({len(seconds)})")
    return lines


def palette(n: int, get_cmap) -> list[tuple]:
    """`n` colors, no two alike: tab20's (its pairs of a dark and a light shade, darks first) up to twenty, else
    evenly spaced hues. A run's spans have ~16 names; tab10's ten colors drew `train` and `publish stall` alike."""
    if n <= 20:
        tab = get_cmap("tab20")
        return [tab(2 * i if i < 10 else 2 * (i - 10) + 1) for i in range(n)]
    hsv = get_cmap("hsv")
    return [hsv(i / n) for i in range(n)]


def draw(run_dir: Path, out: Path, last_s: float = 0.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = read(run_dir)
    lanes = rows(procs)
    t0 = min(s["ts"] for _, _, spans in lanes for s in spans) / 1e6
    end = max(_end(s) / 1e6 for _, _, spans in lanes for s in spans) - t0
    lo = max(0.0, end - last_s) if last_s else 0.0
    names = sorted({s["name"] for _, _, spans in lanes for s in spans})
    colors = dict(zip(names, palette(len(names), plt.get_cmap)))
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(lanes) + 1.5))
    for lane, (_, _, spans) in enumerate(lanes):
        for name in names:
            bars = [((s["ts"] / 1e6 - t0), s["dur"] / 1e6) for s in spans if s["name"] == name
                    and _end(s) / 1e6 - t0 >= lo]
            if bars:
                ax.broken_barh(bars, (lane - 0.4, 0.8), color=colors[name], label=name)
    handles = {}
    for h, label in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(label, h)
    ax.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(lanes)), [p if t == MAIN else f"{p}: {t}" for p, t, _ in lanes])
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
