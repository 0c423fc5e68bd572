"""Pipeline benchmark: the same run with `max_staleness=0` and `=1`; overlap efficiency and speed-up.

Each run is `offpolicy run` in miniature: one learner and `--rollouts` rollout daemons as real
subprocesses (the launcher's own code) on loopback, with the rollout benchmark's model (about 110M
parameters by default) and `--batch` groups x `--n` samples x up to `--new-tokens` tokens per step.
With two or more GPUs the learner gets GPU 0 and the rollouts the others (`run.learner_gpus` and
`run.rollout_gpus`: each daemon's CUDA_VISIBLE_DEVICES; rollout i gets entry i mod len); with one GPU
they share it (split in time). `--learner-gpus 0 --rollout-gpus 1` sets the split explicitly; with
`--backend megatron` the learner is megatron-core (one rank per learner GPU: give `--tp` or let the
ranks be data-parallel). Sources, per step after `--warmup` steps:
- the learner's metrics.jsonl: `train_seconds`, `publish_seconds`, `waited_seconds`, and the step
  time T_step = wall time between step records;
- each rollout's Prometheus histograms, scraped during the run and once more after the learner's last
  step (`Scraper`: each rollout's newest answer is kept): `offpolicy_generate_seconds`
  (T_gen, one generation batch: a lease of a step's groups / rollouts, `lease_groups`),
  `offpolicy_weight_load_seconds` (T_load, the rollout's stall per swap) and, with `rollout.double_buffer`
  on (`--set rollout.double_buffer=true` against `=false` compares the two), `offpolicy_weight_prefetch_seconds`
  (T_prefetch, the background read of each version swapped in, off the critical path; "-" when off). With
  `--set rollout.inflight_updates=true` the learner's metrics.jsonl also give the fraction of tokens generated
  after a switch mid-generation and the tokens' mean staleness (`switched_token_frac`, `token_staleness_mean`). The rollouts' metrics ports lie
  below the kernel's ephemeral range, and `metrics.scrape` refuses a TCP self-connect (a connect to an unused
  ephemeral port can reach itself and read its own request back).
- the learner's `publish_stall_seconds`: what it waited per version for publishing (the previous
  version's writes to end, and the snapshot), beside T_publish, the write time of a version (which runs
  in the background while the next step trains, `weights.overlap_publish`).
Overlap efficiency = max(G, T_train) / T_step, G = generation seconds per step per rollout (the summed
generate time of all rollouts over the window, / rollouts / steps): 1.0 means the step costs only its
longer half. (T_gen per call is not G with several rollouts: they generate side by side, each a part of
the steps, so max(T_gen, T_train) / T_step could pass 1.)
Each run at max_staleness k >= 1 is compared with staleness 0: speed-up and its bound min(T_step(0) / max(G,
T_train), k + 1) (`speedups`: the chain publish -> load -> generate -> train limits any pipeline to k + 1 times).
vLLM or SGLang servers launched by the runs (`rollout.<engine>.mode` http, no urls) are started once for all of
them (`bench/servers.py`: a GPU server's start-up takes minutes); `--fresh-servers` starts each run's own.
`--trace` shows where each step's time went: each run's timeline (`run.trace`, offpolicy/loggers/timeline.py) as
OUT/pipeline-sS.trace.json (Perfetto) and OUT/pipeline-sS.timeline.png. The markdown report is
`bench/pipeline_table.py`'s `table`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from offpolicy.bench.common import free_port
from offpolicy.bench.pipeline_table import table  # noqa: F401 (the bench module's `table`, bench/cli.py)
from offpolicy.bench.rollout import add_model_arguments, model_overrides
from offpolicy.plumbing.metrics import scrape as scrape_metrics
from offpolicy.plumbing.ports import free_block, free_ports


def lease_groups(batch: int, rollouts: int) -> int:
    """Groups per lease: a step's batch split over the rollouts. At max_staleness 1 the batch of step s+1 can only
    start once version s is out, so a whole-batch lease leaves every rollout but one idle for the step: the batch
    waits for one rollout's generate call instead of 1/rollouts of it (measured on the GPT-OSS slice, 2 + 2: the
    rollouts spent most of each step waiting for a lease, docs/benchmarks.md)."""
    return max(1, math.ceil(batch / max(rollouts, 1)))


def speedups(runs: dict[str, dict]) -> dict:
    """Each max_staleness k >= 1 run against the staleness-0 run: overlap efficiency max(G, T_train) / T_step, the
    speed-up T_step(0) / T_step(k) and what this workload allows at most, min(T_step(0) / max(G, T_train), k + 1).

    Why k + 1: the batch of step s + k + 1 needs a version >= s + 1, which exists only once step s has trained, been
    published and been loaded, and step s + k + 1 ends after that batch is generated and trained on. So k + 1 steps
    hold the whole chain publish -> load -> generate -> train at least once: T_step(k) >= chain / (k + 1). At
    staleness 0 a step is that chain (T_step(0) = chain), so no pipeline at staleness k runs more than k + 1 times
    as fast as staleness 0, however well generation and training overlap; the bound is reached when the chain's
    share, T_step(0) / (k + 1), is no longer than the longer side, max(G, T_train). Keys: `by_staleness` (k ->
    overlap, speedup, bound, chain_s = T_step(0) / (k + 1)) and, for k = 1, `overlap_efficiency`, `speedup` and
    `speedup_bound` as before."""
    out: dict = {}
    by: dict[str, dict] = {}
    zero = runs.get("0")
    for k, r in runs.items():
        if k == "0":
            continue
        one: dict = {}
        longer = max(r["gen_busy_s"], r["train_s"])  # NaN where no scrape saw G (see _reduce)
        if math.isfinite(longer):
            one["overlap"] = longer / r["step_s"]
        if zero is not None:
            one["speedup"] = zero["step_s"] / r["step_s"]
            one["chain_s"] = zero["step_s"] / (int(k) + 1)
            if math.isfinite(longer):
                one["bound"] = min(zero["step_s"] / longer, int(k) + 1)
        by[k] = one
    if by:
        out["by_staleness"] = by
    for key, name in (("overlap", "overlap_efficiency"), ("speedup", "speedup"), ("bound", "speedup_bound")):
        if key in by.get("1", {}):
            out[name] = by["1"][key]
    return out


def _warmup(text: str) -> str | int:
    """--warmup's value: auto or a number of steps >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a number of steps (>= 0) or auto")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--warmup", default="auto", type=_warmup,
                   help="first steps left out of the averages; auto: 3 on the CPU, on a GPU 2 x (weights.keep + 2), "
                        "the versions before every recycled shard file is page-locked (warmup_steps)")
    p.add_argument("--batch", type=int, default=8, help="groups per step (learner.batch_groups)")
    p.add_argument("--n", type=int, default=8, help="samples per group")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens per response (rollout.max_new_tokens)")
    p.add_argument("--rollouts", type=int, default=1, help="rollout daemons")
    add_model_arguments(p)
    p.add_argument("--static-cache", choices=["auto", "true", "false"], default="auto",
                   help="rollout.static_cache (auto: on with a GPU where the model allows one)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1],
                   help="algo.max_staleness of each run, compared in turn (0 = synchronous)")
    p.add_argument("--backend", choices=["torch", "megatron"], default="torch", help="learner.backend")
    p.add_argument("--tp", type=int, default=1, help="learner.megatron.tp (--backend megatron)")
    p.add_argument("--learner-gpus", type=int, nargs="+", default=None, metavar="GPU",
                   help="run.learner_gpus (default: GPU 0 when there are two or more, else shared)")
    p.add_argument("--rollout-gpus", nargs="+", default=None, metavar="GPUS",
                   help='run.rollout_gpus, one entry per daemon (mod len), e.g. 1 or 1 2 or "2,3" '
                        "(default: GPUs 1.. when there are two or more, else shared)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="a further config override for both runs (repeatable), e.g. --set learner.lr=1e-6")
    p.add_argument("--dir", default="runs/bench-pipeline", help="parent of the runs' directories")
    p.add_argument("--fresh-servers", action="store_true",
                   help="vLLM or SGLang servers launched by the runs (rollout.<engine>.mode http, no urls): each run "
                        "starts its own (default: one set, started once, serves every run: bench/servers.py)")
    p.add_argument("--trace", action="store_true", help="run.trace=true: each run's timeline, merged into its run "
                   "directory's trace.json (Perfetto) and timeline.png (offpolicy trace), copied to "
                   "OUT/pipeline-sS.trace.json and .timeline.png; its report on stderr")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--dry-run", action="store_true", help="check and print each run's config overrides (the GPUs "
                   "as --learner-gpus / --rollout-gpus name them) and exit; start nothing")


def run(args: argparse.Namespace) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM (`timeout`) stops the daemons too
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def warmup_steps(warmup: str | int, cuda: bool, overrides: list[str]) -> int:
    """--warmup as a number. auto on a GPU: the learner publishes into recycled shard files (weights.reuse_files)
    and each process page-locks a file on its second sighting (weights/maps.py), so versions are written and
    loaded at full speed only once every file of the ring (keep + 2 versions) has come back twice; the first
    2 x (keep + 2) steps ran at a third of that speed in the GPT-OSS slice's pipeline (docs/benchmarks.md)."""
    if str(warmup) != "auto":
        return int(warmup)
    if not cuda:
        return 3
    import msgspec

    from offpolicy.config import WeightsConfig
    from offpolicy.config.load import apply_override

    raw: dict = {}
    for item in overrides:  # weights.keep as the config reads it (the run's own overrides, the last one winning)
        apply_override(raw, item)
    return 2 * (msgspec.convert(raw.get("weights", {}), WeightsConfig, strict=False).keep + 2)


def _run(args: argparse.Namespace) -> dict:
    import torch

    from offpolicy.config import load_config

    gpus = torch.cuda.device_count() if args.device in ("auto", "cuda") else 0
    if args.dry_run:  # the GPUs the options name (else one), as the machine it is meant for would show them
        named = [*(args.learner_gpus or []), *(int(g) for x in args.rollout_gpus or [] for g in str(x).split(","))]
        gpus = 0 if args.device == "cpu" else max(named, default=0) + 1
    cuda = gpus > 0
    learner_gpus, rollout_gpus = split(args, gpus)
    args.warmup = warmup_steps(args.warmup, cuda, args.overrides)
    if args.steps < args.warmup + 2:
        raise SystemExit(f"--steps {args.steps}: the averages need at least 2 steps after --warmup {args.warmup}; "
                         f"pass --steps {args.warmup + 8} or a smaller --warmup")
    dev = "cuda" if cuda else "cpu"
    learner_dev, rollout_dev = dev, dev
    # auto stays auto: the engine takes a static cache where the model allows one (not with sliding-window
    # layers) and says which it took in its log ("decoding with ...")
    static = args.static_cache if args.static_cache == "auto" else args.static_cache == "true"
    compiled = "auto" if static == "auto" else static and cuda and "rollout.compile=false" not in args.overrides
    placed = [f"run.learner_gpus=[{','.join(map(str, learner_gpus))}]",
              "run.rollout_gpus=[" + ", ".join(f'"{g}"' for g in rollout_gpus) + "]"]
    common = [*model_overrides(args), f"model.dtype={'bfloat16' if cuda else 'float32'}", *placed,
              f"learner.backend={args.backend}", f"learner.megatron.tp={args.tp}",
              f"learner.device={learner_dev}", f"rollout.device={rollout_dev}", f"rollout.n_samples={args.n}",
              f"learner.batch_groups={args.batch}", f"learner.micro_batch_groups={args.batch}",
              f"rollout.groups_per_lease={lease_groups(args.batch, args.rollouts)}",
              f"rollout.max_new_tokens={args.new_tokens}",
              f"rollout.static_cache={str(static).lower()}", f"learner.total_steps={args.steps}",
              f"run.rollouts={args.rollouts}", "data.synthetic.task=copy", "learner.lr=1e-5",
              "checkpoint.final=false",  # no checkpoint at the end: a minute or more of a run at 1B+ parameters
              "run.torch_threads=0" if cuda else "run.torch_threads=1", *args.overrides]
    if args.dry_run:  # each run's overrides, checked as the runs would load them; nothing starts
        for st in args.staleness:
            load_config(None, [*common, f"algo.max_staleness={st}"])
            print(f"pipeline run s{st} ({gpus} GPUs; warmup {args.warmup} of {args.steps} steps): " + " ".join(
                shlex.quote(o) for o in [*common, f"algo.max_staleness={st}"]), flush=True)
        raise SystemExit(0)
    runs = {}
    from offpolicy.bench.servers import shared_servers

    with shared_servers(common, Path(args.dir), not args.fresh_servers) as servers:  # started once for all runs
        for s in args.staleness:  # a run that fails is reported as such; the others' figures still count
            try:
                runs[str(s)] = _one_run([*common, f"algo.max_staleness={s}"], args, f"s{s}", servers)
            except (RuntimeError, TimeoutError) as e:
                print(f"pipeline run s{s} failed: {e}", file=sys.stderr, flush=True)
                runs[str(s)] = {"error": str(e)}
    probe = load_config(None, common)
    out = {"engine": probe.rollout.engine, "weights_format": probe.rollout.weights_format,
           "learner_device": learner_dev, "rollout_device": rollout_dev, "learner_gpus": learner_gpus,
           "rollout_gpus": rollout_gpus, "backend": args.backend, "tp": args.tp, "static_cache": static,
           "compile": compiled, "gpus": gpus, "rollouts": args.rollouts, "overrides": args.overrides, "steps": args.steps,
           "warmup": args.warmup, "rows_per_step": args.batch * args.n, "new_tokens": args.new_tokens, "runs": runs}
    ok = {k: r for k, r in runs.items() if "error" not in r}
    if len(ok) < len(runs):
        out["failed"] = [k for k in runs if k not in ok]  # `offpolicy bench` exits 1
    out.update(speedups(ok))
    return out


def split(args: argparse.Namespace, gpus: int) -> tuple[list[int], list[str]]:
    """The learner's and the rollouts' GPUs: the options as given, else GPU 0 and GPUs 1.. when
    there are two or more, else none (every daemon inherits the machine's)."""
    learner = args.learner_gpus
    rollout = [str(g) for g in args.rollout_gpus] if args.rollout_gpus is not None else None
    if learner is None:
        learner = [0] if gpus >= 2 and rollout is None else []
    if rollout is None:
        rollout = [str(g) for g in range(1, gpus)] if gpus >= 2 and learner == [0] else []
    return learner, rollout


def _ports(rollouts: int) -> tuple[int, int, int]:
    """Work and announce ports, and a metrics port with the next `rollouts` ports free too, below the ephemeral
    range (`plumbing.ports`): a connect to an unused port inside it can connect to itself (metrics.scrape refuses
    that too)."""
    base = free_block(rollouts + 3)  # the launcher also takes the two after the rollouts' (`placement`: eval, then
    work, announce = free_ports(2)  # the next daemon's); the walk is then past the block: all distinct
    return work, announce, base


def _one_run(overrides: list[str], args, name: str, servers: list[str] | None = None) -> dict:
    from offpolicy.config import load_config
    from offpolicy.launch.run import Launcher
    from offpolicy.launch.supervisor import how

    work, announce, metrics = _ports(args.rollouts)
    root = f"/dev/shm/offpolicy-bench-{uuid.uuid4().hex[:8]}"
    overrides = [*overrides, *(["run.trace=true"] if args.trace else []),
                 f"run.name={name}", f"run.dir={args.dir}", f"weights.root={root}",
                 f"transport.work_port={work}", f"transport.announce_port={announce}", f"metrics.port={metrics}",
                 f"learner.megatron.master_port={free_port()}"]
    cfg = load_config(None, overrides)
    launcher = Launcher(None, overrides, cfg, servers=servers)
    snaps: list[tuple[int, dict]] = []  # (steps logged when scraped, summed rollout histograms)
    scraper = Scraper([metrics + 1 + i for i in range(args.rollouts)])
    launcher.start()
    timed_out = False
    try:
        deadline = time.monotonic() + args.timeout
        learner = launcher.procs["learner"]
        while learner.poll() is None:
            if time.monotonic() > deadline:  # report what the steps so far measured (below), if enough
                timed_out = True
                break
            if launcher.failed():
                raise RuntimeError(f"{launcher.failed()} failed:\n{launcher.log_tail(launcher.failed()[0])}")
            scraped = scraper.poll()
            if scraped is not None:
                snaps.append((len(_steps(launcher.dir)), scraped))
            time.sleep(0.05)
        if not timed_out and learner.returncode != 0:
            oom = " (not by the run: on Linux most often the kernel's out-of-memory killer)" \
                if learner.returncode == -9 else ""
            raise RuntimeError(f"the learner {how(learner.returncode)}{oom}:\n{launcher.log_tail('learner')}")
        # The figures' window ends at the first scrape after the last step (_reduce): then the rollouts are as
        # far ahead of the learner (staleness, the batch in flight) as at the window's start. Scrapes while
        # the learner checkpoints and stops, or after, would add batches generated for steps never taken (G
        # above T_step, overlap above 1). Only a run too short for two scrapes after warm-up takes the
        # rollouts' histograms to its end.
        if sum(n >= args.warmup for n, _ in snaps) < 2:
            final = scraper.poll(attempts=20)
            if final is not None:
                snaps.append((len(_steps(launcher.dir)), final))
    finally:
        launcher.stop()
        from offpolicy.weights.formats import store_run  # late: torch
        from offpolicy.weights.store import run_dir

        version_bytes = _version_bytes(run_dir(root, store_run(name, cfg.rollout.weights_format)))
        shutil.rmtree(root, ignore_errors=True)
    if args.trace:
        from offpolicy.loggers import timeline

        # trace.json whole; the picture's newest 30 s (steady state); both copied beside OUT/pipeline.json
        for path in timeline.write(launcher.dir, last_s=30.0):
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(args.out) / f"pipeline-{name}.{path.name}")
        for line in timeline.report(launcher.dir):
            print(f"pipeline run {name}: {line}", file=sys.stderr, flush=True)
    steps = _steps(launcher.dir)
    if timed_out:
        seen = [round(b["time"] - a["time"], 2) for a, b in zip(steps, steps[1:])]
        if len(steps) < args.warmup + 2:
            raise TimeoutError(f"pipeline run {name} took over {args.timeout:.0f} s with {len(steps)} of {args.steps} "
                               f"steps logged (seconds between them: {seen}); give it a larger --timeout (a cold "
                               "GPU's first Megatron step compiles its kernels for about a minute), or fewer --steps")
        print(f"pipeline run {name}: over --timeout {args.timeout:.0f} s after {len(steps)} of {args.steps} steps; "
              f"its figures are over those steps", file=sys.stderr, flush=True)
    reduced = _reduce(steps, snaps, args, launcher.dir)
    if reduced["unscraped"]:  # what the scrapes saw: a rollout that stopped answering, or a run over too soon
        print(f"pipeline run {name}: no scrape of the rollouts saw their {' and '.join(reduced['unscraped'])} "
              f"histograms move, so those figures are NaN ({len(snaps)} scrapes kept; {scraper.describe()})",
              file=sys.stderr, flush=True)
    return {**reduced, **_audit(launcher.dir, snaps), "version_bytes": version_bytes, "timed_out": timed_out}


def _audit(run_dir: Path, snaps: list[tuple[int, dict]]) -> dict:
    """What the run lost and duplicated (summary.json's independent count of trained.jsonl; absent where the learner
    wrote none, a run cut by --timeout) and the server engines' loads by proof, the most any scrape counted (loads
    after the last are not in it; an embedded engine counts none: `loads` is every load, the rollouts together)."""
    out: dict = {}
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        out.update({k: s[k] for k in ("prompts_lost", "prompts_duplicated") if k in s})
    # counters only grow: the largest any scrape saw (a scrape at the run's end may find the port answered by another
    # process, or nothing counted: on two H200s the fp8 run's table said "-" though every load was proven)
    for key, name in (("loads_proven", "loads_proven"), ("loads_unproven", "loads_unproven"),
                      ("loads", "offpolicy_weight_load_seconds_count")):
        out[key] = int(max((float(h.get(name, 0)) for _, h in snaps), default=0.0))
    return out


def _version_bytes(store: Path) -> int:
    """Bytes of the safetensors shards of the newest version left in the store (0 if none): the store of the
    rollouts' format (`formats.store_run`), which a low-bit format's versions have to themselves."""
    versions = sorted((d for d in store.glob("v*") if d.name[1:].isdigit()), key=lambda d: int(d.name[1:]))
    return sum(f.stat().st_size for f in versions[-1].glob("*.safetensors")) if versions else 0


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


_SAMPLE = re.compile(r"^(offpolicy_(?:generate|weight_load|weight_prefetch)_seconds_(?:sum|count)) ([0-9.e+-]+)$",
                     re.M)
# a server engine's loads by proof (swap.py counts one per server and version): offpolicy_weight_loads_total{...}
_LOADS = re.compile(r'^offpolicy_weight_loads_total\{([^}]*)\} ([0-9.e+-]+)$', re.M)


def _samples(text: str) -> dict[str, str]:
    """The histograms' sums and counts of one scrape, and the loads by proof as `loads_proven` / `loads_unproven`."""
    out = dict(_SAMPLE.findall(text))
    for labels, value in _LOADS.findall(text):
        key = "loads_proven" if 'proven="true"' in labels else "loads_unproven"
        out[key] = str(float(out.get(key, 0.0)) + float(value))
    return out


class Scraper:
    """The rollouts' generate and load histograms (sum and count), summed over the rollouts. Each port's newest
    answer is kept, so a rollout that misses one poll (busy, or its metrics server not up yet) does not drop
    the others' figures; `poll` gives the sum once every rollout has answered at least once."""

    def __init__(self, ports: list[int]) -> None:
        self.ports, self.latest = ports, {}
        self.answers: dict[int, int] = {}  # per port: scrapes answered, missed, and when it last answered
        self.misses: dict[int, int] = {}
        self.last_answer: dict[int, float] = {}
        self.started = time.monotonic()

    def describe(self) -> str:
        """Each port's scrape record, for an error that the histograms cannot explain by themselves."""
        return "; ".join(
            f"port {p}: {self.answers.get(p, 0)} answers, {self.misses.get(p, 0)} misses, last answer "
            + (f"{self.last_answer[p] - self.started:.1f} s after the start, generate count "
               f"{self.latest[p].get('offpolicy_generate_seconds_count', 'absent')}" if p in self.last_answer else "never")
            for p in self.ports)

    def poll(self, attempts: int = 1) -> dict | None:
        """Scrape every port (up to `attempts` passes over those that did not answer) and sum the newest."""
        fresh: set[int] = set()
        for i in range(attempts):
            for port in set(self.ports) - fresh:
                text = scrape_metrics(port, timeout=2)
                if text is None:
                    self.misses[port] = self.misses.get(port, 0) + 1
                    continue
                self.latest[port] = _samples(text)
                self.answers[port] = self.answers.get(port, 0) + 1
                self.last_answer[port] = time.monotonic()
                fresh.add(port)
            if len(fresh) == len(self.ports):
                break
            if i + 1 < attempts:
                time.sleep(0.1)
        if len(self.latest) < len(self.ports):
            return None  # not up yet, or already gone
        total: dict[str, float] = {}
        for samples in self.latest.values():
            for key, value in samples.items():
                total[key] = total.get(key, 0.0) + float(value)
        return total


def _reduce(steps: list[dict], snaps: list[tuple[int, dict]], args, run_dir: Path) -> dict:
    """Means over the steps after warm-up, from metrics.jsonl and the scraped histograms."""
    if len(steps) < args.warmup + 2:
        raise RuntimeError(f"{run_dir}: {len(steps)} steps logged, need more than warmup + 1")
    kept = steps[args.warmup:]
    mean = lambda key: sum(s[key] for s in kept) / len(kept)  # noqa: E731
    some = lambda key: mean(key) if all(key in s for s in kept) else float("nan")  # noqa: E731 (NaN: not logged)
    step_s = (kept[-1]["time"] - kept[0]["time"]) / (len(kept) - 1)
    # the histograms from the first scrape after warm-up to the last one; a run too short for that
    # (a smoke test) falls back to everything since the rollouts started
    since, first = next(((n, h) for n, h in snaps if n >= args.warmup), (0, {}))
    # ... to the first scrape after the last step was logged: later ones (the learner checkpointing, stopping)
    # would count batches generated ahead for steps never taken
    until, last = next(((n, h) for n, h in snaps if n == snaps[-1][0]), (0, {}))
    unscraped: list[str] = []  # histograms no scrape saw move (a run over before a rollout answered again)

    def window(kind: str, optional: bool = False) -> tuple[float, float, int]:
        """(seconds, calls) of `kind` between the first kept scrape and the last, and the steps between them;
        NaN seconds and no call where no scrape saw one (the learner's own figures still count; said unless
        `optional`: the prefetch histogram stays empty without rollout.double_buffer)."""
        fresh = last.get(f"offpolicy_{kind}_seconds_count", 0) > first.get(f"offpolicy_{kind}_seconds_count", 0)
        h0, n0 = (first, since) if fresh else ({}, 0)
        count = last.get(f"offpolicy_{kind}_seconds_count", 0) - h0.get(f"offpolicy_{kind}_seconds_count", 0)
        if count <= 0:
            if not optional:
                unscraped.append(kind)
            return float("nan"), 0, 1
        seconds = last[f"offpolicy_{kind}_seconds_sum"] - h0.get(f"offpolicy_{kind}_seconds_sum", 0)
        return seconds, count, max(1, until - n0)

    def per_call(kind: str, optional: bool = False) -> float:
        seconds, count, _ = window(kind, optional)
        return seconds / count if count else float("nan")

    def prefill(kind: str) -> float:
        """Prompt tokens a generate call prefilled, `computed` or `cached` by the engine's prefix cache, over the
        generate histogram's window (NaN where the engine says none: the torch engine)."""
        key, calls = f'offpolicy_rollout_prompt_tokens_total{{kind="{kind}"}}', window("generate", True)[1]
        h0 = first if last.get(key, 0) > first.get(key, 0) else {}
        return (last[key] - h0.get(key, 0)) / calls if key in last and calls else float("nan")

    gen_seconds, _, gen_steps = window("generate")
    tokens = sum(s["tokens"] for s in kept[1:])
    return {"step_s": step_s, "gen_s": per_call("generate"), "load_s": per_call("weight_load"),
            "prefetch_s": per_call("weight_prefetch", optional=True),
            "gen_busy_s": gen_seconds / max(1, args.rollouts) / gen_steps,
            "stall_s": mean("publish_stall_seconds") if all("publish_stall_seconds" in s for s in kept)
            else mean("publish_seconds"),
            "train_s": mean("train_seconds"), "publish_s": mean("publish_seconds"), "wait_s": mean("waited_seconds"),
            "logprob_diff": some("logprob_diff_mean"), "grad_norm": some("grad_norm"),
            # rollout.inflight_updates: tokens generated after a version switch mid-generation, and tokens' staleness
            "switched_token_frac": some("switched_token_frac"), "token_staleness": some("token_staleness_mean"),
            # SGLang and vLLM: what a generate call computed in prefill and what their prefix cache held
            "prefill_computed": prefill("computed"), "prefill_cached": prefill("cached"),
            "tokens_per_s": tokens / (kept[-1]["time"] - kept[0]["time"]), "steps_logged": len(steps),
            "histograms_from_step": since, "unscraped": sorted(set(unscraped)),
            "run_dir": str(run_dir)}
