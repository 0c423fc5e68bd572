"""The spread of a learning run over seeds, alone and beside a CPU load (issue 52): does learning depend on timing?

    python benchmarks/learning_spread.py CONFIG --seeds 0 1 2 --load 0 2 [--set KEY=VALUE ...] [--out DIR]

For every (load, seed) pair, one `offpolicy run CONFIG` after another with its own run directory, weight store,
ports and Megatron rendezvous port, and the seed in model.seed, data.synthetic.seed and rollout.seed; while it
runs, `load` busy-loop processes compete for the cores (the load generator: a CI machine's neighbours). Per run
it reads summary.json and metrics.jsonl: final and initial reward, steps trained with stale groups (staleness
mean > 0), mean staleness, stale groups dropped, mean and max logprob difference (behaviour vs learner), low-side
clip fraction, the last steps' entropy and the wall time. Prints a markdown table and writes OUT/spread.json
(one row per run, and each run's reward curve). `--set` overrides go to every run (e.g. algo.logp_old=recompute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import free_ports  # noqa: E402


def busy(n: int) -> list[subprocess.Popen]:
    """`n` processes that each keep a core busy until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stats(run_dir: Path, tail: int) -> dict:
    """One run's row: summary.json's figures and the metrics of its steps (the last `tail` for entropy)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    mean = lambda key, rs=rows: statistics.fmean(r[key] for r in rs) if rs else float("nan")
    return dict(steps=summary["steps"], initial_reward=summary["initial_reward_mean"],
                final_reward=summary["final_reward_mean"], lost=summary["prompts_lost"],
                duplicated=summary["prompts_duplicated"], stale_dropped=summary["groups_dropped_stale"],
                leases_expired=summary.get("leases_expired"), stale_steps=sum(r["staleness_mean"] > 0 for r in rows),
                staleness_mean=mean("staleness_mean"), logprob_diff_mean=mean("logprob_diff_mean"),
                logprob_diff_max=max(r["logprob_diff_max"] for r in rows), clip_frac_low=mean("clip_frac_low"),
                entropy_last=mean("entropy", rows[-tail:]), wall_s=summary["wall_seconds"],
                rewards=[round(r["reward_mean"], 4) for r in rows])


def one_run(config: str, seed: int, load: int, overrides: list[str], out: Path, timeout: float) -> dict:
    name = f"load{load}-seed{seed}"
    work, announce, server, master = free_ports(4)
    store = Path(f"/dev/shm/offpolicy-spread-{os.getpid()}-{name}")
    cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", config, f"run.dir={out / name}",
           f"weights.root={store}", f"transport.work_port={work}",
           f"transport.announce_port={announce}", "metrics.port=0", f"rollout.vllm.server_port={server}",
           f"learner.megatron.master_port={master}", f"model.seed={seed}", f"data.synthetic.seed={seed}",
           f"rollout.seed={seed}", *overrides]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(out / "cache" / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(out / "cache" / "inductor")}
    hogs = busy(load)
    t = time.monotonic()
    try:
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout after {timeout:.0f} s"
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        shutil.rmtree(store, ignore_errors=True)  # the run frees its versions; its store's directories stay
    run_dirs = [p.parent for p in (out / name).glob("*/summary.json")]
    if rc != 0 or not run_dirs:
        return dict(name=name, seed=seed, load=load, error=f"exit {rc}", wall_s=time.monotonic() - t)
    return dict(name=name, seed=seed, load=load, **stats(run_dirs[0], tail=10))


def table(rows: list[dict]) -> str:
    head = ("| load | seed | initial reward | final reward | steps with stale groups | staleness mean | stale dropped "
            "| logprob diff mean / max | clip low | entropy (last 10) | lost / dup | wall s |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['load']} | {r['seed']} | {r['error']} |" + " |" * 10)
            continue
        lines.append(f"| {r['load']} | {r['seed']} | {r['initial_reward']:.3f} | **{r['final_reward']:.3f}** | "
                     f"{r['stale_steps']}/{r['steps']} | {r['staleness_mean']:.2f} | {r['stale_dropped']} | "
                     f"{r['logprob_diff_mean']:.3f} / {r['logprob_diff_max']:.2f} | {r['clip_frac_low']:.3f} | "
                     f"{r['entropy_last']:.2f} | {r['lost']} / {r['duplicated']} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a run config, e.g. configs/gptoss-tiny.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy-loop processes beside each run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/learning-spread")
    p.add_argument("--timeout", type=float, default=2400, help="seconds one run may take")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for load in args.load:
        for seed in args.seeds:
            print(f"== load {load}, seed {seed}", flush=True)
            rows.append(one_run(args.config, seed, load, args.overrides, out, args.timeout))
            r = rows[-1]
            print(f"   {r['error']}" if "error" in r else f"   final reward {r['final_reward']:.3f}", flush=True)
            (out / "spread.json").write_text(json.dumps(dict(config=args.config, overrides=args.overrides, rows=rows),
                                                        indent=1) + "\n")
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
