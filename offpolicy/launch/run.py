"""`offpolicy run CONFIG`: one learner and `run.rollouts` rollout daemons as real subprocesses.

The very same daemons a cluster runs, on loopback: same sockets, shared memory and metrics. The
launcher checks the ports, starts the learner, then the rollouts (each with its own index and, if
metrics are on, its own port: metrics.port + 1 + index), shows live progress from the learner's
metrics.jsonl, and when the learner finishes waits for the rollouts to leave on its Goodbye (and for
the eval daemon, started when `eval.every_versions` is set, to finish its versions). It supervises
what it started (offpolicy/launch/launcher.py): a process that exits unexpectedly is restarted within the
run.supervise budget, a stalled run says so, and nothing it started outlives it, even when it is
SIGKILLed (offpolicy/launch/supervisor.py, offpolicy/launch/reaper.py). Ctrl-C or SIGTERM stops every daemon cleanly.
Each daemon's output goes to <run dir>/logs/<daemon>.log. At the end it draws reward.png and prints
summary.json.

GPU placement (`placement`): `run.learner_gpus` and `run.rollout_gpus` become each daemon's
CUDA_VISIBLE_DEVICES (indices into the launcher's own visible GPUs when it has CUDA_VISIBLE_DEVICES
itself); rollout daemon i gets entry i mod len. With `learner.backend=megatron` and several learner
GPUs the launcher starts one learner rank per GPU as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK; the
rendezvous port is `learner.megatron.master_port`): rank 0 is "learner" (the hub), the others
"learner-r1", ... follow it and are stopped after it.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from offpolicy.config import Config
from offpolicy.launch.launcher import Launcher
from offpolicy.launch.placement import (
    SERVER_ENGINES,
    is_server,
    launched_servers,
    placement,
    ports_in_use,
    visible_devices,
)

__all__ = ["Launcher", "launch", "launched_servers", "placement", "ports_in_use", "visible_devices"]


def launch(config_path: str | None, overrides: list[str], cfg: Config, resume: bool = False) -> int:
    from offpolicy.config import ConfigError
    from offpolicy.plumbing import preflight, runlock

    try:  # a live run of this name, a missing model, nothing to resume: refused before anything changes
        # (model.gguf: the one change made first, converting the GGUF file into model.path once)
        runlock.probe(cfg)
        if cfg.model.gguf:
            from offpolicy.models.gguf_import import ensure_imported

            if not (Path(cfg.model.path or "") / "config.json").exists():
                print(f"converting model.gguf={cfg.model.gguf} into model.path={cfg.model.path} ({cfg.model.dtype}) ...",
                      flush=True)
            if ensure_imported(cfg.model):
                print(f"converted: {cfg.model.path}", flush=True)
        preflight.check_model(cfg)
        if cfg.learner.backend == "megatron":
            preflight.check_megatron()
        if resume:
            preflight.check_resume(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    busy = ports_in_use(cfg)
    if busy:
        print(f"error: {preflight.ports_message(busy)}", file=sys.stderr)
        return 2
    try:
        placement(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = launched_servers(cfg)  # the servers `offpolicy run` starts, if any
    if engine == "vllm" and cfg.rollout.weights_format != "native":
        import torch

        if cfg.rollout.device == "cpu" or not torch.cuda.is_available():
            print(f"error: config field rollout.weights_format: is {cfg.rollout.weights_format}, but vLLM on a CPU "
                  "runs native weights only (docs/vllm.md); use rollout.weights_format=native, or GPUs",
                  file=sys.stderr)
            return 2
    from offpolicy.launch.progress import Progress

    launcher = Launcher(config_path, overrides, cfg, resume)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        if stopping["signal"] is not None:  # stopping already: a second signal must not cut the stop short
            return
        stopping["signal"] = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, on_signal)
    t0 = time.time()
    gpus = (f" (learner GPUs {cfg.run.learner_gpus or 'inherited'}, rollout GPUs "
            f"{cfg.run.rollout_gpus or 'inherited'})") if cfg.run.learner_gpus or cfg.run.rollout_gpus else ""
    servers = f" + {cfg.run.rollouts} {SERVER_ENGINES[engine]} servers" if engine else ""
    print(f"offpolicy run {cfg.run.name}: 1 learner + {cfg.run.rollouts} rollout daemons{servers}{gpus}; "
          f"run directory {launcher.dir}", flush=True)
    code = 1
    try:
        launcher.start()
        with Progress(cfg) as progress:
            code = launcher.wait(progress)
    except KeyboardInterrupt:
        stopping["signal"] = stopping["signal"] or signal.SIGINT  # Ctrl-C: a second one must not cut the stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("\nstopping: SIGTERM to every daemon ...", file=sys.stderr)
        code = 130
    finally:
        stopped = launcher.stop()
    if stopped is not None and stopped.exits:  # something still ran: what the stop took, each process
        print(stopped.line(), file=sys.stderr, flush=True)
    # a process that the stop's SIGTERM ended did as it was told (the stop's line names it), not a failure to report;
    # so did a server the stop SIGKILLed past run.supervise.kill_grace_s (SGLang's take longer than that on SIGTERM)
    told = {n for n in (stopped.exits if stopped is not None else ())
            if launcher.procs[n].returncode == -signal.SIGTERM
            or (is_server(n) and launcher.procs[n].returncode == -signal.SIGKILL)}
    for name in launcher.failed():
        if name not in launcher.reported and name not in told:
            launcher.report_exit(name)
    if not cfg.weights.keep_after_run:
        _free_store(cfg)
    chaos = launcher.chaos_report()
    return _report(launcher.dir, code, time.time() - t0, chaos)


def _free_store(cfg: Config) -> None:
    """The retention policy: the run's weight store leaves /dev/shm with the launcher (docs/operations.md)."""
    from offpolicy.plumbing import stores

    try:
        size = stores.free(cfg.weights.root, cfg.run.name)
    except FileNotFoundError:
        return
    except stores.StoreLive as e:  # a learner outlived the launcher's stop
        print(f"kept the weight store: {e}", file=sys.stderr)
        return
    print(f"freed the weight store {cfg.weights.root}/{cfg.run.name} ({size / 2**20:,.1f} MiB; "
          "weights.keep_after_run=true keeps it)")


def _report(run_dir: Path, code: int, wall: float, chaos: dict | None = None) -> int:
    summary_path = run_dir / "summary.json"
    if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size:
        from offpolicy.loggers.plot import plot_rewards

        print(f"reward curve: {plot_rewards(run_dir)}")
    _report_eval(run_dir)
    if not summary_path.exists():
        print(f"no summary.json in {run_dir}: the learner did not finish (see {run_dir}/logs)", file=sys.stderr)
        return code or 1
    summary = json.loads(summary_path.read_text())
    summary["launcher_wall_seconds"] = round(wall, 2)
    if chaos is not None:  # run.chaos: its kills and what they cost (chaos.json has each kill)
        summary["chaos_kills"] = chaos["kills"]
        summary["chaos_stall_max_s"] = chaos["stall_max_s"]
        print(f"chaos: {chaos['kills']} kills ({', '.join(f'{k} {n}' for k, n in chaos['kills_by_kind'].items())}); "
              f"stall after a kill, mean / largest (s): " + ", ".join(
                  f"{k} {chaos['stall_mean_s'][k]:.1f} / {chaos['stall_max_s'][k]:.1f}" for k in chaos['stall_max_s'])
              + f"; a step takes {chaos['usual_step_s']:.2f} s ({run_dir / 'chaos.json'})")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    keys = ("steps", "wall_seconds", "initial_reward_mean", "final_reward_mean", "max_staleness_seen",
            "prompts_lost", "prompts_duplicated", "groups_dropped_stale", "tokens_per_s")
    width = max(map(len, keys))
    print("\n".join(f"  {k:<{width}}  {summary.get(k)}" for k in keys))
    print(f"summary: {summary_path}")
    return code


def _report_eval(run_dir: Path) -> None:
    from offpolicy.loggers.runlog import read_jsonl

    rows = read_jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").exists() else []
    done = [r for r in rows if "pass_at_k" in r]
    if not done:
        return
    from offpolicy.loggers.plot import plot_eval

    last = max(done, key=lambda r: r["version"])
    skipped = [r["version"] for r in rows if "skipped" in r]
    print(f"eval: {len(done)} versions evaluated{f', skipped {skipped}' if skipped else ''}; version {last['version']}: "
          + ", ".join(f"pass@{k} {v:.3f}" for k, v in last["pass_at_k"].items())
          + f"; pass@k curve: {plot_eval(run_dir)}")

