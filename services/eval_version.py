"""`offpolicy eval` (one-shot; the daemon that follows a run is `offpolicy-eval`, services/eval_daemon.py):
evaluate one weight version (pass@k, mean reward, response length) and report it.

    offpolicy eval [CONFIG] [overrides] [--weights PATH | --version N|latest] [--out DIR]

The weights: a version directory (manifest.json; e.g. /dev/shm/offpolicy/<run>/v<N>/ or a
checkpoint's hf/), an HF model directory (config.json + safetensors), a version of the run's store
(`weights.root`/`run.name`) opened through `offpolicy.weights.subscribe`, or by default the model the
config builds. What to evaluate and how comes from the `eval` section (docs/eval.md). Results go to
DIR (default <run.dir>/<run.name>/eval/<label>/): results.jsonl (resumable: run the same command
again to finish an interrupted evaluation), report.json and report.md; the overall table is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from offpolicy.config import ConfigError
from offpolicy.services.args import parser, resolve


def open_version(cfg, version: str, wait_s: float):
    """The store version `version` (an integer or "latest") of cfg's run, held, through `subscribe`."""
    from offpolicy.weights import list_versions, subscribe
    from offpolicy.weights.store import run_dir

    w, latest = cfg.weights, version == "latest"
    start = 0 if latest else int(version)
    store = run_dir(w.root, cfg.run.name)
    for wv in subscribe(w.root, cfg.run.name, start=start, latest_only=latest, hold=True, timeout_s=wait_s,
                        poll_s=0.1, verify=w.verify):
        if not latest and wv.version != start:
            wv.close()
            raise ConfigError(f"weight version {start} is no longer in {store} (it keeps the newest "
                            f"weights.keep): it has {list_versions(w.root, cfg.run.name)}")
        return wv
    raise ConfigError(f"no weight version {version} in {store} (has {list_versions(w.root, cfg.run.name)}); "
                    "check weights.root and run.name, or wait for it with --wait SECONDS")


def main(rest: list[str]) -> int:
    p = parser("offpolicy eval", "Evaluate one weight version now and exit (the eval daemon that follows a "
                                 "run is offpolicy-eval): eval.n_samples samples per prompt of eval.data, scored by "
                                 "eval.reward; pass@k for each eval.k, mean reward and response length, per prompt "
                                 "and overall (JSON + markdown). Resumable.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--weights", help="a version directory (manifest.json) or an HF model directory (config.json)")
    src.add_argument("--version", help="version N (or 'latest') of the run's store weights.root/run.name")
    p.add_argument("--wait", type=float, default=0.0, help="with --version: seconds to wait for it to appear")
    p.add_argument("--out", help="output directory (default <run.dir>/<run.name>/eval/<label>)")
    args = p.parse_intermixed_args(rest)
    cfg = resolve(args)
    from offpolicy.plumbing import preflight
    from offpolicy.services.args import checked, setup_runtime

    if args.weights:
        checked(preflight.check_weights_dir, args.weights)
    else:
        checked(preflight.check_model, cfg)

    setup_runtime(cfg, "eval")
    from offpolicy.eval.evaluator import Evaluator
    from offpolicy.launch.progress import EvalProgress
    from offpolicy.loggers.runlog import run_path
    from offpolicy.weights import WeightVersion

    weights, model_path = None, None
    label = Path(cfg.model.path).name if cfg.model.path else "initial"  # the config's own model
    if args.weights:
        path = Path(args.weights)
        if (path / "manifest.json").exists():
            weights = WeightVersion(path, verify=cfg.weights.verify)
            label = f"v{weights.version}"
        elif (path / "config.json").exists():
            model_path, label = str(path), path.resolve().name
        else:
            raise AssertionError("preflight.check_weights_dir let through a directory it should refuse")
    elif args.version:
        weights = checked(open_version, cfg, args.version, args.wait)
        label = f"v{weights.version}"
    out = Path(args.out) if args.out else run_path(cfg) / "eval" / label
    try:
        evaluator = Evaluator(cfg, model_path=model_path)
        if weights is not None:
            with weights:
                evaluator.load(weights)
        with EvalProgress(label) as progress:
            rep = evaluator.run(out, str(weights.path if weights is not None else model_path or label),
                                on_batch=progress)
    except ValueError as e:  # data, reward, weights or results-file problems: the message names the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = (out / "report.md").read_text()
    print(text.split("## Per prompt")[0].rstrip())
    print(f"\nreport: {out / 'report.json'}, {out / 'report.md'}; per-prompt samples: {out / 'results.jsonl'}")
    return 0 if rep is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
