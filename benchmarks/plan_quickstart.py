"""The CPU quickstart at several rollout counts and both staleness settings, with the background load.

What `offpolicy plan validate` compares its CPU predictions with (docs/deploy.md). For each rollout
count R and max_staleness S it runs `offpolicy run CONFIG run.rollouts=R algo.max_staleness=S` (the
launcher's own daemons) and reduces the learner's metrics.jsonl over the steps after `--warmup`:
step seconds, tokens/s, train / wait / publish seconds. The machine is shared (other sessions' tests
run on the same cores), so while each run goes a sampler counts the other sessions with a running
thread (the kernel shares the cores between sessions when autogroup scheduling is on, as it is on the
dev VM, and the launcher starts each daemon in its own session): `background` is their mean number,
which the planner's CPU model shares the cores with (`events.Shared`).

    python benchmarks/plan_quickstart.py --rollouts 1 2 4 --staleness 0 1 --repeat 2 --out runs/plan-quickstart.json

It first runs the calibration the planner's CPU constants come from: `offpolicy bench pipeline` at
staleness 0 with one rollout daemon and the quickstart's model, batch and lease (T_gen, T_load,
T_train, T_publish measured apart, since at staleness 0 nothing overlaps), under the same sampler.
With `--repeat N` the whole sequence (calibration, then every run) is made N times, interleaved, so
a change of the machine's load falls on all configurations alike; the planner takes medians. With
`--quiet B` each run waits (up to --wait seconds) until the other runnable tasks average below B over
3 s, and a run whose own mean background was above B is made again (up to --retries times): a run
on cores that other work fills measures the other work more than the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def _stat(path: str) -> list[str]:
    """Fields of a /proc stat file after the command name (field 3, the state, is [0])."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def _runnable_sessions() -> dict[int, set[int]]:
    """Session id -> pids of that session with a running (R) thread, over the whole machine."""
    out: dict[int, set[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            session = int(_stat(f"/proc/{d}/stat")[3])
            running = any(_stat(f"/proc/{d}/task/{t}/stat")[0] == "R" for t in os.listdir(f"/proc/{d}/task"))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if running:
            out.setdefault(session, set()).add(int(d))
    return out


def _sessions_of(root: int) -> set[int]:
    """Sessions of `root` and its descendants (the launcher starts each daemon in a session of its own)."""
    children: dict[int, list[int]] = {}
    sessions: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = _stat(f"/proc/{d}/stat")
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(int(st[1]), []).append(int(d))
            sessions[int(d)] = int(st[3])
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p in sessions:
            out.add(sessions[p])
        todo.extend(children.get(p, []))
    return out


def sample_background(root: int, stop: threading.Event, out: list[float], every: float = 0.1) -> None:
    """Other sessions with a running thread, every `every` s. The kernel's autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) shares the cores fairly between sessions, not threads,
    and the launcher gives each daemon its own session: so each daemon competes with this many others."""
    own = {os.getsid(0)}
    while not stop.wait(every):
        ours = _sessions_of(root) | own
        out.append(len([s for s in _runnable_sessions() if s not in ours]))


BENCH = ["--steps", "60", "--warmup", "10", "--batch", "16", "--n", "16", "--new-tokens", "6", "--layers", "2",
         "--hidden", "64", "--mlp", "256", "--vocab", "16", "--rollouts", "1", "--staleness", "0",
         "--set", "model.arch.num_attention_heads=4", "--set", "model.arch.num_key_value_heads=4",
         "--set", "model.arch.max_position_embeddings=64", "--set", "model.arch.tie_word_embeddings=false",
         "--set", "data.synthetic.length=4", "--set", "rollout.groups_per_lease=8", "--set", "learner.lr=0.001"]


def wait_quiet(limit: float, wait: float) -> float:
    """Sample the background (no run of ours going) for 3 s at a time until its mean is below `limit`
    or `wait` seconds passed; the last mean."""
    deadline = time.monotonic() + wait
    while True:
        samples: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=sample_background, args=(os.getpid(), stop, samples), daemon=True)
        t.start()
        time.sleep(3)
        stop.set()
        t.join()
        mean = statistics.mean(samples) if samples else 0.0
        if mean < limit or time.monotonic() > deadline:
            return mean
        time.sleep(5)


def quietly(fn, args: argparse.Namespace):
    """`fn()` (returning a dict with `background`), made again while its background exceeded --quiet."""
    for attempt in range(args.retries + 1):
        if args.quiet:
            wait_quiet(args.quiet, args.wait)
        res = fn()
        if not args.quiet or res["background"] < args.quiet or attempt == args.retries:
            return {**res, "attempts": attempt + 1}
    raise AssertionError("unreachable")


def sampled(cmd: list[str]) -> tuple[float, str]:
    """Run `cmd` to its end while sampling the background; (mean background, stderr)."""
    samples: list[float] = []
    stop = threading.Event()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    sampler = threading.Thread(target=sample_background, args=(proc.pid, stop, samples), daemon=True)
    sampler.start()
    _, err = proc.communicate(timeout=900)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return (statistics.mean(samples) if samples else 0.0), err


def calibration(out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "bench", "pipeline", "--out", str(out_dir),
           "--dir", str(out_dir / "runs"), *BENCH]
    background, _ = sampled(cmd)
    run = json.loads((out_dir / "pipeline.json").read_text())["runs"]["0"]
    return {"command": " ".join(["offpolicy", "bench", "pipeline", *BENCH]), "background": background,
            **{k: run[k] for k in ("step_s", "gen_s", "load_s", "train_s", "publish_s", "wait_s", "tokens_per_s")}}


def one_run(config: str, rollouts: int, staleness: int, steps: int, warmup: int, run_dir: Path, ports: int) -> dict:
    name = f"plan-r{rollouts}-s{staleness}"
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", config, f"run.rollouts={rollouts}",
           f"algo.max_staleness={staleness}", f"run.name={name}", f"run.dir={run_dir}", f"learner.total_steps={steps}",
           f"transport.work_port={ports}", f"transport.announce_port={ports + 1}", f"metrics.port={ports + 2}"]
    t0 = time.time()
    background, _ = sampled(cmd)
    rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    kept = rows[warmup:]
    span = kept[-1]["time"] - kept[0]["time"]
    mean = lambda key: statistics.mean(r[key] for r in kept)  # noqa: E731
    return {"rollouts": rollouts, "max_staleness": staleness, "steps": len(rows), "warmup": warmup,
            "step_s": span / (len(kept) - 1), "tokens_per_s": sum(r["tokens"] for r in kept[1:]) / span,
            "tokens_per_step": mean("tokens"), "train_s": mean("train_seconds"), "wait_s": mean("waited_seconds"),
            "publish_s": mean("publish_seconds"), "response_len_mean": mean("response_len_mean"),
            "background": background, "wall_s": round(time.time() - t0, 1),
            "loadavg": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"))
    p.add_argument("--rollouts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dir", default="runs/plan-quickstart", help="parent of the runs' directories")
    p.add_argument("--port", type=int, default=17555, help="first of the three ports each run uses")
    p.add_argument("--repeat", type=int, default=1, help="times the whole sequence is made, interleaved")
    p.add_argument("--quiet", type=float, default=0.0, help="wait for, and require, a background below this (0 = off)")
    p.add_argument("--wait", type=float, default=180.0, help="seconds to wait for a quiet machine before a run")
    p.add_argument("--retries", type=int, default=2, help="runs made again when their background was above --quiet")
    p.add_argument("--out", default="runs/plan-quickstart.json")
    args = p.parse_args()
    cals, results = [], []
    for rep in range(args.repeat):
        cal = {"repeat": rep, **quietly(lambda: calibration(Path(args.dir) / "calibration"), args)}
        print(json.dumps(cal), flush=True)
        cals.append(cal)
        for r in args.rollouts:
            for s in args.staleness:
                res = {"repeat": rep, **quietly(lambda: one_run(args.config, r, s, args.steps, args.warmup,
                                                                Path(args.dir), args.port), args)}
                print(json.dumps(res), flush=True)
                results.append(res)
    doc = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "unix_time": round(time.time()),
           "calibrations": cals, "runs": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
