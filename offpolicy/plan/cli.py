"""`offpolicy plan`: rank cluster layouts by predicted throughput; `validate`; `calibrate`.

    offpolicy plan --model gpt-oss-20b --nodes 8 --gpus-per-node 8 --gpu h100 [--layout SPEC ...] [--out DIR]
    offpolicy plan validate [--quickstart runs/plan-quickstart.json] [--layouts benchmarks/results/gptoss20b-*.json]
    offpolicy plan calibrate BENCH_DIR [--out FILE]

Without --layout every split of the nodes is searched (learner nodes, the fastest learner layout
that fits, rollout servers of 1/2/4/8 GPUs). Output: the ranked markdown tables on stdout and, with
--out, DIR/plan.md, DIR/plan.json and DIR/plan.png. No GPU needed: the full search of the example above
simulates every candidate layout at staleness 0 and 1, some seconds on 2 cores (docs/deploy.md); the
layouts given with --layout, or fewer --steps, take less. `--help` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="offpolicy plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", required=True, help="preset (gpt-oss-20b, gpt-oss-120b, qwen2.5-0.5b, ...), an HF "
                   "config.json or a model directory")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the cluster, learner and rollout together")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--gpu", default="h100", help="h100, h800 or h200")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default: the preset's)")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="network GB/s between two nodes (50 = 400 Gb/s)")
    p.add_argument("--host-gib", type=float, default=1024.0, help="host memory of a node, GiB (a learner node holds "
                   "the host optimizer, when a layout needs one, and the weight versions in /dev/shm)")
    p.add_argument("--host-cores", type=int, default=64, help="CPU cores of a node (the host optimizer's Adam runs on "
                   "them: learner.host_adam_gbps_per_core each)")
    p.add_argument("--config", help="a run config: batch, n, max_new_tokens, leases and the publish path from it")
    p.add_argument("--batch", type=int, default=None, help="learner.batch_groups [128]")
    p.add_argument("--n", type=int, default=None, help="rollout.n_samples [8]")
    p.add_argument("--prompt-tokens", type=int, default=512, help="mean prompt length")
    p.add_argument("--max-new-tokens", type=int, default=None, help="rollout.max_new_tokens [8192]")
    p.add_argument("--lengths", default="lognormal:1500:0.8",
                   help="response lengths before the cut: fixed:L, uniform:LO:HI or lognormal:MEDIAN:SIGMA")
    p.add_argument("--groups-per-lease", type=int, default=None, help="rollout.groups_per_lease [0 = batch / servers]")
    p.add_argument("--publish", choices=["sha256", "none", "fast"], default=None,
                   help="weights path: fast (default: what a GPU learner's weights.* auto gives, recycled page-locked "
                   "shard files, no checksum), none (every version into fresh pages: weights.reuse_files=false), "
                   "sha256 (each rank hashes what it writes: weights.checksum=sha256)")
    p.add_argument("--engine", choices=["sglang", "vllm", "torch"], default="sglang",
                   help="rollout engine of the searched layouts (a layout's rollout_engine= overrides it): its load "
                   "(vLLM in place or rebuilt, the torch engine's double buffer, SGLang's) and memory; one decode "
                   "model for all")
    p.add_argument("--expert-bits", type=float, default=16.0, help="rollout expert weights: 16 (bf16, what the learner "
                   "publishes) or 4.25 (MXFP4)")
    p.add_argument("--layout", action="append", default=[], help="a candidate: learner_nodes=2,tp=2,ep=8,pp=1,"
                   "rollout_tp=4 (learner keys left out are searched; colocated=true shares the GPUs); repeatable")
    p.add_argument("--steps", type=int, default=12, help="learner steps simulated per layout and staleness")
    p.add_argument("--fresh-pages", action="store_true", help="simulate a run's start, not its steady state: its "
                   "first 2 x (weights.keep + 2) versions are written and loaded in fresh pages (what a short "
                   "`offpolicy bench pipeline` run measures; docs/benchmarks.md)")
    p.add_argument("--top", type=int, default=12, help="layouts shown (0 = all)")
    p.add_argument("--calibration", default=None, help="calibration YAML [offpolicy/plan/calibration.yaml]")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="sets",
                   help="replace a calibration constant (marked assumed), e.g. learner.mfu_16384=0.35")
    p.add_argument("--out", help="directory for plan.md, plan.json, plan.png")
    return p


def workload(args: argparse.Namespace):
    from offpolicy.plan.workload import Lengths, Workload

    base = {}
    if args.config:
        from offpolicy.config import load_config

        cfg = load_config(args.config, [])
        w = cfg.weights  # resolved as a GPU learner resolves auto: no checksum (unless weights.verify), reused files
        checksum = w.checksum if w.checksum != "auto" else ("sha256" if w.verify else "none")
        reuse = w.reuse_files is not False
        path = "sha256" if checksum == "sha256" else ("fast" if reuse and w.register_maps else "none")
        base = dict(batch_groups=cfg.learner.batch_groups, n=cfg.rollout.n_samples,
                    max_new_tokens=cfg.rollout.max_new_tokens, groups_per_lease=cfg.rollout.groups_per_lease,
                    prefetch_leases=cfg.rollout.prefetch_leases, publish=path)
    given = dict(batch_groups=args.batch, n=args.n, max_new_tokens=args.max_new_tokens,
                 groups_per_lease=args.groups_per_lease, publish=args.publish)
    wl = Workload(**{**base, **{k: v for k, v in given.items() if v is not None}},
                  prompt_tokens=args.prompt_tokens, lengths=Lengths.parse(args.lengths), steps=args.steps,
                  fresh_pages=args.fresh_pages)
    wl.check()
    return wl


def plan_main(argv: list[str]) -> int:
    args = _plan_parser().parse_args(argv)
    from offpolicy.plan import calibration, report, search
    from offpolicy.plan.hardware import Cluster, device
    from offpolicy.plan.shapes import load_shape

    try:
        shape = load_shape(args.model)
        cluster = Cluster(args.nodes, args.gpus_per_node, device(args.gpu, args.gpu_mem), args.inter_gbps,
                          args.host_gib, args.host_cores)
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ValueError("--nodes and --gpus-per-node must be >= 1")
        cal = calibration.load(args.calibration)
        if args.sets:
            cal = cal.replaced(**{k: float(v) for k, _, v in (s.partition("=") for s in args.sets)})
        wl = workload(args)
        layouts = [search.parse_layout(t, shape, cluster, wl, cal, args.expert_bits, args.engine)
                   for t in args.layout] or None
        evals = search.plan(shape, cluster, wl, cal, layouts, args.expert_bits, args.engine)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = report.markdown(evals, shape, cluster, wl, cal, args.top)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.md").write_text(f"`offpolicy plan {' '.join(argv)}`\n\n{text}\n")
        (out / "plan.json").write_text(json.dumps(to_json(evals, cluster), indent=1) + "\n")
        if any(e.runs for e in evals):
            report.plot(evals, cluster, out / "plan.png", args.top or 10)
        plotted = f" {out / 'plan.png'}" if any(e.runs for e in evals) else ""
        print(f"\nwritten: {out / 'plan.md'} {out / 'plan.json'}{plotted}")
    return 0


def to_json(evals, cluster) -> list[dict]:
    return [{"layout": e.candidate.label(cluster),
             "learner": vars(e.candidate.learner) | {"dp": e.candidate.learner.dp},
             "server": vars(e.candidate.server), "colocated": e.candidate.colocated, "fits": e.fits,
             "problems": e.problems, "learner_mem_gib": e.learner_mem.gib(), "rollout_mem_gib": e.rollout_mem.gib(),
             "parts": e.parts, "runs": {str(s): r for s, r in e.runs.items()}} for e in evals]


def validate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy plan validate", description="Predicted vs measured tokens/s and "
                                "staleness 0 -> 1 speed-up of every recorded pipeline run, and the sharded publish and "
                                "the loads against the runs they are calibrated on (docs/deploy.md).")
    p.add_argument("--quickstart", help="JSON of benchmarks/plan_quickstart.py (the CPU quickstart runs)")
    p.add_argument("--layouts", nargs="+", default=[], metavar="JSON", help="benchmarks/megatron_layouts.py --model "
                   "JSONs (e.g. benchmarks/results/gptoss20b-*.json): each layout's step time, GPU and host memory")
    p.add_argument("--host-cores", type=int, default=64, help="CPU cores of the node the --layouts runs ran on")
    p.add_argument("--calibration", default=None, help="calibration YAML [offpolicy/plan/calibration.yaml]")
    args = p.parse_args(argv)
    from offpolicy.plan import calibration, validate

    if args.layouts:
        cal = calibration.load(args.calibration)
        try:
            runs = [r for path in args.layouts for r in validate.layout_runs(path)]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(validate.layout_table(validate.layout_rows(runs, cal, args.host_cores)))
        return 0
    cases = validate.gpu_cases() + [validate.cpu_pipeline_case()]
    if args.quickstart:
        cases += validate.quickstart_cases(args.quickstart)
    cal = calibration.load(args.calibration)
    print(validate.table(validate.rows(cases, cal)))
    print()
    print(validate.learner_table(validate.learner_rows(cal)))
    from offpolicy.plan import publish_runs

    print()
    print("The publish and load today (sharded, in the background; each engine's load): the recorded runs they are "
          "calibrated on (offpolicy/plan/publish_runs.py)\n")
    print(publish_runs.table(publish_runs.publish_rows(cal), publish_runs.pipeline_rows(cal)))
    return 0


def calibrate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy plan calibrate", description="Re-derive the measured calibration "
                                "entries from `offpolicy bench` JSONs (weights.json, rollout.json, transport.json).")
    p.add_argument("bench_dir", help="directory of `offpolicy bench` JSONs (its --out, e.g. runs/bench)")
    p.add_argument("--calibration", default=None, help="the file to start from [the shipped one]")
    p.add_argument("--out", required=True, help="calibration YAML to write")
    args = p.parse_args(argv)
    from offpolicy.plan import calibration

    new = calibration.from_bench(args.bench_dir)
    if not new:
        print(f"error: no weights.json, rollout.json or transport.json in {args.bench_dir}", file=sys.stderr)
        return 2
    cal = calibration.load(args.calibration)
    for name, entry in new.items():
        old = f"{cal.entries[name].value:g} -> " if name in cal.entries else ""
        print(f"{name}: {old}{entry.value:g}")
    merged = calibration.Calibration({**cal.entries, **new}, args.out)
    Path(args.out).write_text(merged.dump())
    print(f"written: {args.out}")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "validate":
        return validate_main(argv[1:])
    if argv and argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    return plan_main(argv)
