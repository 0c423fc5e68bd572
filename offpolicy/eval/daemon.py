"""The eval daemon: follows a run's weight versions and evaluates every `eval.every_versions`-th one.

A second user of `offpolicy.weights.subscribe` beside the rollout daemon, and nothing the learner ever
waits for: the learner does not know it exists. A follower thread takes every version as it is
published (`latest_only=False`, `hold=True`): a wanted one (version % every_versions == 0, and the run's
last, learner.total_steps) is held in the store, so the collector leaves it until it has been
evaluated; the others are let go at once. At most `eval.max_pending_versions` wait; past that the oldest
waiting one is let go and recorded as skipped ("behind"), so a slow evaluation never fills shared
memory. The main thread loads each waiting version into its own engine (on its own device) and runs
`Evaluator`, whose per-prompt results in <run dir>/eval/v<N>/ are resumable.

It starts following only once the learner has announced a version (the learner clears the store of
an earlier run of the same name at start; versions seen before that could be that run's). Each
evaluated version appends a line to <run dir>/eval.jsonl (versions already there are not evaluated
again, so `offpolicy run --resume` continues) and sets the `offpolicy_eval_*` gauges; a wanted version
the store had collected before the daemon could hold it is recorded as skipped ("collected"). The
daemon ends after the learner's Goodbye once nothing waits (or on SIGTERM, between batches; a batch
still running `STOP_DEADLINE_S` after the signal is given up: its prompts are evaluated again on the next
start), and then draws <run dir>/eval.png. With `run.loggers`, each result also goes to the trackers at step = its
version (offpolicy.loggers, role "eval").
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import deque

import msgspec
import zmq

from offpolicy.config import Config, learner_host
from offpolicy.loggers.runlog import read_jsonl, run_path
from offpolicy.loggers.trackers import eval_scalars, open_trackers
from offpolicy.plumbing.lifetime import exit_deadline
from offpolicy.plumbing.metrics import EvalMetrics, serve
from offpolicy.weights import WeightVersion, subscribe
from offpolicy.wire import protocol, transport
from offpolicy.wire.keys import CurveClient, apply_client, load_client

log = logging.getLogger("offpolicy.eval")

STOP_DEADLINE_S = 10.0  # after SIGTERM the daemon is gone this long later at the latest (docs/operations.md)


def wanted(version: int, every: int, last: int) -> bool:
    return version % every == 0 or version == last


def first_announcement(address: str, curve: CurveClient | None, stop: threading.Event) -> int | None:
    """Wait for the learner's first WeightAnnouncement on its PUB socket; its version, or None on stop/Goodbye."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        apply_client(sub, curve)
    sub.connect(address)
    try:
        while not stop.is_set():
            if not sub.poll(250):
                continue
            try:
                msg, _ = protocol.decode(sub.recv_multipart())
            except protocol.ProtocolError:
                continue
            if isinstance(msg, protocol.WeightAnnouncement):
                return msg.version
            if isinstance(msg, protocol.Goodbye):
                return None
        return None
    finally:
        sub.close(0)


class EvalDaemon:
    def __init__(self, cfg: Config):
        self.cfg, self.m = cfg, EvalMetrics()
        self.dir = run_path(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "eval.jsonl"
        self.done = {r["version"] for r in read_jsonl(self.log_path)} if self.log_path.exists() else set()
        self.stop = threading.Event()
        self.pending: deque[WeightVersion] = deque()
        self.changed = threading.Condition()
        self.ended = False
        self.seen: set[int] = set()
        self.trackers = None  # run.loggers: each result also goes to the trackers at step = version

    def _record(self, record: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.done.add(record["version"])
        values = eval_scalars(record)
        if values and any(name != "console" for name in self.cfg.run.loggers):
            if self.trackers is None:  # opened at the first result: the learner has set up the run dir by then
                self.trackers = open_trackers(self.cfg, self.dir, resume=True, config=msgspec.to_builtins(self.cfg),
                                              role="eval")
            self.trackers.log(record["version"], record, values)

    def _follow(self, announce: str, curve: CurveClient | None) -> None:
        e, w = self.cfg.eval, self.cfg.weights
        try:
            if first_announcement(announce, curve, self.stop) is None:
                return
            for wv in subscribe(w.root, self.cfg.run.name, announce=announce, start=0, latest_only=False, hold=True,
                                stop=self.stop, poll_s=0.25, curve=curve, verify=w.verify):
                self.seen.add(wv.version)
                if wv.version in self.done or not wanted(wv.version, e.every_versions, self.cfg.learner.total_steps):
                    wv.close()
                    continue
                with self.changed:
                    self.pending.append(wv)
                    if len(self.pending) > e.max_pending_versions:
                        old = self.pending.popleft()
                        old.close()
                        log.warning("eval is %d versions behind: skipping version %d (raise eval.every_versions or "
                                    "eval.max_pending_versions, or give the eval daemon a faster device)",
                                    len(self.pending), old.version)
                        self.m.skipped.labels("behind").inc()
                        self._record({"version": old.version, "skipped": "behind"})
                    self.m.pending.set(len(self.pending))
                    self.changed.notify_all()
        finally:
            with self.changed:
                self.ended = True
                self.changed.notify_all()

    def _next(self) -> WeightVersion | None:
        with self.changed:
            while not self.pending and not self.ended and not self.stop.is_set():
                self.changed.wait(0.5)
            if self.stop.is_set() or not self.pending:
                return None
            wv = self.pending.popleft()
            self.m.pending.set(len(self.pending))
            return wv

    def run(self) -> int:
        from offpolicy.eval.evaluator import Evaluator  # imports torch and the engine

        def stop_requested(*_) -> None:
            if not self.stop.is_set():
                exit_deadline(STOP_DEADLINE_S, 0, "the eval daemon")
            self.stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop_requested)
        serve(self.m.registry, self.cfg.metrics.port, self.cfg.metrics.host)
        t = self.cfg.transport
        curve = load_client(t.keys_dir, t.client_key) if t.curve else None
        evaluator = Evaluator(self.cfg)
        log.info("evaluating every %d versions of run %s on %d prompts x %d samples (results in %s)",
                 self.cfg.eval.every_versions, self.cfg.run.name, len(evaluator.prompts), self.cfg.eval.n_samples,
                 self.log_path)
        follower = threading.Thread(target=self._follow, args=(transport.tcp(learner_host(self.cfg), t.announce_port),
                                                               curve), name="weights", daemon=True)
        follower.start()
        while (wv := self._next()) is not None:
            self._evaluate(evaluator, wv)
        self.stop.set()
        follower.join(5)
        self._record_collected()
        if self.trackers is not None:
            self.trackers.close()
        if self.log_path.exists():
            from offpolicy.loggers.plot import plot_eval

            plot_eval(self.dir)
        return 0

    def _evaluate(self, evaluator, wv: WeightVersion) -> None:
        t0, waiting = time.perf_counter(), len(self.pending)
        with wv:
            load_s = evaluator.load(wv)
        rep = evaluator.run(self.dir / "eval" / f"v{wv.version}", str(wv.path), stop=self.stop)
        if rep is None:
            return  # stopped: the next start resumes this version's results
        o, seconds = rep["overall"], time.perf_counter() - t0
        self._record({"version": wv.version, "time_unix": time.time(), "pass_at_k": o["pass_at_k"],
                      "reward_mean": o["reward_mean"], "response_tokens_mean": o["response_tokens_mean"],
                      "prompts": o["prompts"], "samples": o["samples"], "seconds": round(seconds, 3),
                      "load_seconds": round(load_s, 3), "samples_per_s": rep["throughput"]["samples_per_s"],
                      "waiting": waiting,
                      "report": f"eval/v{wv.version}/report.json"})
        for k, v in o["pass_at_k"].items():
            self.m.pass_at_k.labels(k).set(v)
        self.m.reward.set(o["reward_mean"])
        self.m.tokens.set(o["response_tokens_mean"])
        self.m.version.set(wv.version)
        self.m.versions.inc()
        self.m.samples.inc(rep["throughput"]["samples"])
        self.m.seconds.observe(seconds)
        log.info("version %d: %s, reward %.3f, %.1f s", wv.version,
                 ", ".join(f"pass@{k} {v:.3f}" for k, v in o["pass_at_k"].items()), o["reward_mean"], seconds)

    def _record_collected(self) -> None:
        """Wanted versions below the newest seen that were never held: the store collected them first."""
        if not self.seen:
            return
        e = self.cfg.eval
        for v in range(max(self.seen) + 1):
            if v not in self.done and v not in self.seen and wanted(v, e.every_versions, self.cfg.learner.total_steps):
                self.m.skipped.labels("collected").inc()
                self._record({"version": v, "skipped": "collected"})
