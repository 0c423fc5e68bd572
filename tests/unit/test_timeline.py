"""The run's timeline: spans written by `plumbing.trace.Tracer`, merged and drawn by `loggers.timeline`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

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
    # ts and the end are each rounded to a microsecond (spans that meet stay met), so a length may differ by one
    assert lines[0]["dur"] >= 9_999 and abs(lines[1]["dur"] - 2000) <= 1


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
    assert timeline.summary(trace_dir(cfg).parent)["learner"] == {"train": {"count": 3, "seconds": 1.5,
                                                                            "shortest": 0.5, "longest": 0.5}}


def test_the_cli_says_what_to_do_without_a_timeline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "trace", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "run.trace=true" in r.stderr


def _span(name, ts, dur, thread="MainThread", **args):
    return {"name": name, "ts": ts, "dur": dur, "thread": thread, "args": args}


def test_a_lane_puts_work_beside_the_writer_on_its_own_track_and_ends_meet(tmp_path):
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true"])
    tr = Tracer(cfg, "learner")
    start = 1000.1234567
    tr.add("wait batch", start, 0.1000004, step=0)
    tr.add("train", start + 0.1000004, 0.2, step=0)  # starts where the wait ended, to the microsecond
    tr.add("publish", start + 0.05, 0.3, lane="publish", version=1)
    tr.flush()
    spans = timeline.read(trace_dir(cfg).parent)["learner"]
    assert [s["thread"] for s in spans] == ["MainThread", "MainThread", "publish"]
    assert spans[0]["ts"] + spans[0]["dur"] == spans[1]["ts"]


def test_tracks_keep_nesting_spans_together_and_move_a_partial_overlap_aside():
    outer, inner, after = _span("train", 0, 100), _span("stall", 10, 20), _span("wait", 100, 5)
    overlap = _span("publish", 90, 30)  # begins in `outer`, ends after it: Perfetto would misdraw it there
    assert timeline.tracks([after, overlap, inner, outer]) == [[outer, inner, after], [overlap]]
    assert timeline.tracks([]) == []
    # a CI machine's rollout: `score and send` began 14 us before its 38,908 us `generate` ended (the wall clock,
    # slewed, ran slower than perf_counter): it follows the call, not a second track
    gen, score = _span("generate", 1_000_000, 38_908), _span("score and send", 1_038_894, 1_001)
    assert timeline.tracks([gen, score]) == [[gen, {**score, "ts": 1_038_908, "dur": 987}]]
    late = _span("score and send", 1_038_808, 1_001)  # 100 us before the end: beyond 0.1 % of 38,908, a real overlap
    assert timeline.tracks([gen, late]) == [[gen], [late]]
    rows = timeline.rows({"rollout-0": [_span("load", 0, 5)], "learner": [outer, overlap, _span("receive", 5, 1, "hub")]})
    assert [(p, t) for p, t, _ in rows] == [("learner", "MainThread"), ("learner", "MainThread (2)"),
                                            ("learner", "hub"), ("rollout-0", "MainThread")]


def _run() -> dict[str, list[dict]]:
    """Two versions published, loaded by two rollouts; a lease's groups received in two batches."""
    return {
        "learner": [_span("publish", 0, 10, "publish", version=0), _span("publish", 500, 20, "publish", version=1),
                    _span("receive", 300, 2, "hub", groups=6, leases=[7]),
                    _span("receive", 340, 3, "hub", groups=3, leases=[7, 8]),
                    _span("train", 330, 150, step=0)],
        "rollout-0": [_span("load", 12, 4, version=0), _span("generate", 20, 250, groups=8, version=0),
                      _span("score and send", 270, 40, lease=7, groups=8), _span("load", 560, 5, version=1)],
        "rollout-1": [_span("load", 15, 4, version=0), _span("score and send", 320, 10, lease=8, groups=1),
                      _span("prefetch", 525, 30, "prefetch", version=1), _span("score and send", 600, 1, lease=99)],
    }


def test_links_join_a_publish_to_its_loads_and_a_send_to_its_receives():
    procs = _run()
    got = [(kind, src[0], src[1]["name"], dst[0], dst[1]["name"], dst[1]["ts"]) for kind, src, dst in
           timeline.links(procs)]
    assert got == [("groups", "rollout-0", "score and send", "learner", "receive", 300),
                   ("groups", "rollout-0", "score and send", "learner", "receive", 340),
                   ("groups", "rollout-1", "score and send", "learner", "receive", 340),
                   ("announce", "learner", "publish", "rollout-0", "load", 12),
                   ("announce", "learner", "publish", "rollout-0", "load", 560),
                   ("announce", "learner", "publish", "rollout-1", "load", 15),
                   ("announce", "learner", "publish", "rollout-1", "prefetch", 525)]
    lags = timeline.lags(procs)
    assert lags["announce to load"] == [2e-6, 40e-6, 5e-6, 5e-6]  # from the publish's end (10, 520)
    assert sorted(lags["send to receive"]) == [13e-6, 33e-6]  # the last batch ends at 343: lease 8 sent by 330, 7 by 310


def test_events_give_each_track_a_unique_tid_and_bind_flows_inside_their_spans():
    doc = timeline.events(_run())
    ev = doc["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert len({tid for _, tid in threads}) == len(threads) == 6  # learner: main, hub, publish; rollout-1: prefetch
    assert sorted(threads.values()) == ["MainThread"] * 3 + ["hub", "prefetch", "publish"]
    spans = [e for e in ev if e["ph"] == "X"]
    flows = [e for e in ev if e["ph"] in "sf"]
    assert len(flows) == 2 * 7 and {e["id"] for e in flows} == set(range(1, 8))
    for e in flows:  # each end lies inside a span on its own track
        assert any(s["tid"] == e["tid"] and s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in spans), e
        assert (e["ph"] == "f") == (e.get("bp") == "e")
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    assert all(starts[e["id"]]["name"] == e["name"] and starts[e["id"]]["cat"] == e["cat"] for e in flows)


def test_report_says_per_process_where_the_time_went_and_the_lags(tmp_path):
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    for proc, spans in _run().items():
        tr = Tracer(cfg, proc)
        for s in spans:
            tr.add(s["name"], s["ts"] / 1e6, s["dur"] / 1e6, lane=s["thread"], **s["args"])
        tr.flush()
    lines = timeline.report(trace_dir(cfg).parent)
    assert lines[0].startswith("learner: publish 0.00 s (2 x 0.0 ms, 0.0-0.0), receive ")
    assert lines[0].endswith("train 0.00 s (1 x 0.0 ms)")  # one span: no spread
    load = timeline.summary(trace_dir(cfg).parent)["rollout-0"]["load"]
    assert (load["count"], load["shortest"], load["longest"]) == (2, 4e-6, 5e-6)
    assert [line.split(":")[0] for line in lines] == ["learner", "rollout-0", "rollout-1", "announce to load",
                                                      "send to receive"]
    assert lines[-1] == "send to receive: median 0.0 ms, max 0.0 ms (2)"


def test_a_sharded_publishs_parts_are_drawn_inside_its_span(tmp_path):
    """The learner's Announcer puts the parts a sharded publish reports (Published.phases) on the publish lane, each
    clipped to the version's publish span (snapshot to commit), so Perfetto nests them and the report sums them."""
    import asyncio

    from offpolicy.learner.loop import Announcer
    from offpolicy.plumbing.metrics import LearnerMetrics
    from offpolicy.weights.store import Published

    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    now = time.time()

    class Writing:
        version = 4

        def wait(self):
            return Published(version=4, path="/x/v4", total_bytes=10, seconds=0.5, committed=now + 60,
                             phases=[("encode", now - 3600, 0.1), ("write", now + 1, 0.2), ("commit", now + 59, 5.0)])

    class Store:
        last = []

        def begin(self, version, backend, overlap):
            return Writing()

    class Hub:
        async def announce(self, msg):
            pass

    tracer = Tracer(cfg, "learner")
    announce = Announcer(Store(), None, Hub(), LearnerMetrics(), tracer)

    async def publish():
        await announce(4)
        await announce.settle()

    asyncio.run(publish())
    tracer.flush()
    spans = {s["name"]: s for s in map(json.loads, (trace_dir(cfg) / "learner.jsonl").read_text().splitlines())}
    outer = spans.pop("publish")
    assert set(spans) == {"publish: encode", "publish: write", "publish: commit"}
    for s in spans.values():
        assert s["thread"] == "publish" and s["args"] == {"version": 4}
        assert outer["ts"] <= s["ts"] and s["ts"] + s["dur"] <= outer["ts"] + outer["dur"]
    assert abs(spans["publish: write"]["dur"] - 200_000) <= 1 and spans["publish: commit"]["dur"] <= 1_000_001


def test_every_span_name_gets_a_color_of_its_own():
    from matplotlib import pyplot as plt

    from offpolicy.loggers.timeline import palette

    for n in (1, 16, 20, 23):
        colors = palette(n, plt.get_cmap)
        assert len(colors) == n and len(set(colors)) == n, n


def _generate(seconds: float, computed: int, cached: int) -> dict:
    return {"name": "generate", "ts": 0, "dur": int(seconds * 1e6), "thread": "MainThread",
            "args": {"prefill_computed": computed, "prefill_cached": cached}}


def test_prefill_sets_a_rollouts_generate_calls_against_what_each_computed(tmp_path):
    """The spread of generate's seconds against the prompt tokens each call computed (the rest its prefix cache
    held): one workload's calls took 0.47-1.9 s on an H200 with SGLang (twenty-first session)."""
    calls = [_generate(0.5, 16_000, 112_000), _generate(1.5, 64_000, 64_000), _generate(1.0, 40_000, 88_000)]
    said = timeline.prefill(calls + [{"name": "load", "ts": 0, "dur": 5, "args": {}}])
    assert (said["calls"], said["fewest"], said["most"]) == (3, 16_000, 64_000)
    assert abs(said["cached_share"] - (112 + 64 + 88) / 3 / 128) < 1e-9 and said["r"] > 0.99
    assert timeline.prefill(calls[:1])["r"] is None  # too few calls to correlate
    assert timeline.prefill([_generate(0.5, 16_000, 0), _generate(0.6, 16_000, 0), _generate(0.7, 16_000, 0)])["r"] \
        is None  # every call computed the same
    assert timeline.prefill([{"name": "generate", "ts": 0, "dur": 5, "args": {"groups": 2}}]) is None  # not said
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    tr = Tracer(cfg, "rollout-0")
    for s in calls:
        tr.add(s["name"], 0.0, s["dur"] / 1e6, **s["args"])
    tr.flush()
    lines = timeline.report(trace_dir(cfg).parent)
    assert lines[1] == ("rollout-0: generate's prefill computed 16,000-64,000 prompt tokens a call (3 calls), the "
                        "prefix cache held 69% of them; seconds against tokens computed: r = 1.00"), lines


def test_publishes_beside_a_train_step_are_told_apart_from_those_while_the_learner_waited(tmp_path):
    """Steady versions only: those written into files made new (their page faults) or through pinned buffers, a file
    met for the first time (the H200's slice, twenty-second session: 550 ms against 105 ms through its map, beside a
    step or not), are left out."""
    spans = [_span("train", 0, 500_000), _span("publish", 100_000, 300_000, fresh_files=0),  # beside the step
             _span("publish", 600_000, 105_000, fresh_files=0),  # the learner waits
             _span("publish", 800_000, 107_000, fresh_files=0, staged_files=0),
             _span("publish", 1_000_000, 900_000, fresh_files=1), _span("train", 1_000_000, 500_000),  # a new file
             _span("publish", 1_600_000, 550_000, fresh_files=0, staged_files=2), _span("train", 1_600_000, 500_000)]
    assert timeline.publish_beside_train(spans) == {"beside": [0.3], "alone": [0.105, 0.107]}
    assert timeline.publish_beside_train(spans[1:5]) is None  # nothing beside a step to compare with
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    tr = Tracer(cfg, "learner")
    for s in spans:
        tr.add(s["name"], s["ts"] / 1e6, s["dur"] / 1e6, **s["args"])
    tr.flush()
    assert timeline.report(trace_dir(cfg).parent)[1] == (
        "learner: publish beside a train step 300.0 ms (1 x, 300.0-300.0), while the learner waited 106.0 ms (2 x, "
        "105.0-107.0) (steady versions: pooled files, registered maps)")


def test_generate_calls_beside_a_background_staging_are_told_apart(tmp_path):
    """vLLM stages the next version inside its server's worker while it generates; its generate calls spread 0.59-2.60
    s on an H200 where SGLang's did not: the report splits a rollout's calls by whether most of each ran beside a
    prefetch."""
    spans = [_span("generate", 0, 1_000_000), _span("prefetch", 100_000, 600_000),  # beside: 0.6 of the call
             _span("generate", 1_000_000, 500_000), _span("load", 1_500_000, 100_000),
             _span("generate", 1_600_000, 1_200_000), _span("prefetch", 2_500_000, 200_000)]  # 0.2 of it: alone
    assert timeline.generate_beside_prefetch(spans) == {"beside": [1.0], "alone": [0.5, 1.2]}
    assert timeline.generate_beside_prefetch(spans[2:4]) is None
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    tr = Tracer(cfg, "rollout-0")
    for s in spans:
        tr.add(s["name"], s["ts"] / 1e6, s["dur"] / 1e6)
    tr.flush()
    lines = timeline.report(trace_dir(cfg).parent)
    assert "rollout-0: generate beside a prefetch 1000.0 ms (1 x, 1000.0-1000.0), without one 850.0 ms (2 x, " \
        "500.0-1200.0)" in lines, lines


def test_the_staging_s_cpu_time_is_reported_against_its_wall_time(tmp_path):
    """The `prefetch` spans carry their thread's CPU seconds (where the engine measured them): the report sums them
    against the spans' wall seconds, telling a staging that held a core from one that waited on I/O."""
    spans = [_span("prefetch", 0, 600_000, cpu_seconds=0.45), _span("prefetch", 1_000_000, 400_000, cpu_seconds=0.05),
             _span("prefetch", 2_000_000, 100_000)]  # an older trace's: no CPU time
    assert timeline.prefetch_cpu(spans) == pytest.approx((0.5, 1.0))
    assert timeline.prefetch_cpu(spans[2:]) is None
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    tr = Tracer(cfg, "rollout-0")
    for s in spans:
        tr.add(s["name"], s["ts"] / 1e6, s["dur"] / 1e6, **s["args"])
    tr.flush()
    assert "rollout-0: prefetch on the CPU 0.50 s of its 1.00 s (50 %)" in timeline.report(trace_dir(cfg).parent)


def test_a_wall_clock_step_back_during_a_span_does_not_make_the_next_one_overlap_it(tmp_path, monkeypatch):
    """A CI machine's rollout had its `score and send` drawn on a second track: the wall clock stepped back during
    the span before it (NTP, a hypervisor's time sync). Spans take `now()`, the wall clock read once and advanced
    by perf_counter: a process's spans stay back to back whatever the wall clock does."""
    from offpolicy.plumbing import trace

    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.trace=true", "run.name=r"])
    tr = Tracer(cfg, "rollout-0")
    real = time.time
    with tr.span("generate", groups=8):
        time.sleep(0.002)
        monkeypatch.setattr(time, "time", lambda: real() - 1.0)  # stepped back a second
    with tr.span("score and send"):
        pass
    t0, began = time.perf_counter(), trace.now()  # the daemons' way: a start from now(), a perf_counter length
    time.sleep(0.002)
    monkeypatch.setattr(time, "time", lambda: real() - 2.0)
    tr.add("wait lease", began, time.perf_counter() - t0)
    tr.add("load", trace.now(), 0.001, version=3)
    tr.flush()
    spans = timeline.read(trace_dir(cfg).parent)["rollout-0"]
    assert [s["name"] for s in spans] == ["generate", "score and send", "wait lease", "load"]
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(spans, spans[1:]))
    assert [t for _, t, _ in timeline.rows({"rollout-0": spans})] == ["MainThread"]
    assert abs(spans[0]["ts"] / 1e6 - real()) < 60  # still the wall clock's time of day
