"""`offpolicy run CONFIG`: one learner and `run.rollouts` rollout daemons as real subprocesses.

The very same daemons a cluster runs, on loopback: same sockets, shared memory and metrics. The
launcher checks the ports, starts the learner, then the rollouts (each with its own index and, if
metrics are on, its own port: metrics.port + 1 + index), shows live progress from the learner's
metrics.jsonl, and when the learner finishes waits for the rollouts to leave on its Goodbye (and for
the eval daemon, started when `eval.every_versions` is set, to finish its versions). Ctrl-C
or SIGTERM stops every daemon cleanly. Each daemon's output goes to <run dir>/logs/<daemon>.log.
At the end it draws reward.png and prints summary.json.

GPU placement (`placement`): `run.learner_gpus` and `run.rollout_gpus` become each daemon's
CUDA_VISIBLE_DEVICES (indices into the launcher's own visible GPUs when it has CUDA_VISIBLE_DEVICES
itself); rollout daemon i gets entry i mod len. With `learner.backend=megatron` and several learner
GPUs the launcher starts one learner rank per GPU as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK; the
rendezvous port is `learner.megatron.master_port`): rank 0 is "learner" (the hub), the others
"learner-r1", ... follow it and are stopped after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from offpolicy.config import Config


def launches_vllm(cfg: Config) -> bool:
    """`offpolicy run` starts the vLLM servers itself: rollout.vllm.mode http with no urls."""
    return cfg.rollout.engine == "vllm" and cfg.rollout.vllm.mode == "http" and not cfg.rollout.vllm.urls


def ports_in_use(cfg: Config) -> list[str]:
    """`field=port` of the ports the run's daemons will bind that are taken now (learner rank 0's, incl.
    the Megatron rendezvous port, each daemon's metrics port, and the vLLM servers `offpolicy run` starts)."""
    from offpolicy.preflight import busy_ports, learner_ports

    wanted = learner_ports(cfg)
    if cfg.metrics.port:
        for i in range(1, cfg.run.rollouts + 1 + (cfg.eval.every_versions > 0)):
            wanted[f"metrics.port (+{i})"] = (cfg.metrics.host, cfg.metrics.port + i)
    if launches_vllm(cfg):
        for i in range(cfg.run.rollouts):
            wanted[f"rollout.vllm.server_port (+{i})" if i else "rollout.vllm.server_port"] = (
                "127.0.0.1", cfg.rollout.vllm.server_port + i)
    return busy_ports(wanted)


def visible_devices(gpus: list[int | str], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES naming `gpus` (ints, or strings such as "2,3"); with the launcher's own
    CUDA_VISIBLE_DEVICES `parent` set, the indices count within it."""
    wanted = [int(g) for entry in gpus for g in str(entry).split(",")]
    if parent is None:
        return ",".join(map(str, wanted))
    have = [d.strip() for d in parent.split(",") if d.strip()]
    missing = [g for g in wanted if g >= len(have)]
    if missing:
        raise ValueError(f"run.learner_gpus/run.rollout_gpus name GPU {missing[0]} but the launcher sees only "
                         f"{len(have)} (CUDA_VISIBLE_DEVICES={parent!r}): indices count within it")
    return ",".join(have[g] for g in wanted)


def placement(cfg: Config, environ: dict[str, str] | None = None) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """The daemons to start, in order: (name, module, extra arguments, environment additions)."""
    env = os.environ if environ is None else environ
    parent = env.get("CUDA_VISIBLE_DEVICES")
    daemons = []
    lg = cfg.run.learner_gpus
    learner_env = {"CUDA_VISIBLE_DEVICES": visible_devices(lg, parent)} if lg else {}
    ranks = len(lg) if lg and cfg.learner.backend == "megatron" else 1
    for r in range(ranks):
        rank_env = dict(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r)) if ranks > 1 else {}
        daemons.append(("learner" if r == 0 else f"learner-r{r}", "offpolicy.services.learner", [],
                        {**learner_env, **rank_env}))
    for i in range(cfg.run.rollouts):
        extra = [f"metrics.port={cfg.metrics.port + 1 + i}"] if cfg.metrics.port else []
        rg = cfg.run.rollout_gpus
        gpu_env = {"CUDA_VISIBLE_DEVICES": visible_devices([rg[i % len(rg)]], parent)} if rg else {}
        daemons.append((f"rollout-{i}", "offpolicy.services.rollout", [*extra, "--index", str(i)], gpu_env))
    if cfg.eval.every_versions:  # the eval daemon: metrics port after the rollouts', GPUs eval.gpus
        extra = [f"metrics.port={cfg.metrics.port + 1 + cfg.run.rollouts}"] if cfg.metrics.port else []
        eg = cfg.eval.gpus
        daemons.append(("eval", "offpolicy.services.eval_daemon", extra,
                        {"CUDA_VISIBLE_DEVICES": visible_devices(eg, parent)} if eg else {}))
    return daemons


class Launcher:
    def __init__(self, config_path: str | None, overrides: list[str], cfg: Config, resume: bool = False):
        from offpolicy.runlog import prepare_run_dir, run_path

        self.config_path, self.overrides, self.cfg, self.resume = config_path, overrides, cfg, resume
        self.dir = run_path(cfg) if resume else prepare_run_dir(run_path(cfg))
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.reported: set[str] = set()  # daemons whose failure was reported already

    def _start(self, name: str, module: str, extra: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", module]
        if self.config_path:
            cmd += ["--config", self.config_path]
        self._spawn(name, [*cmd, *self.overrides, *extra], env)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.dir / "logs" / f"{name}.log", "a" if self.resume else "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, **env} if env else None)

    def start(self) -> None:
        urls = self._start_vllm() if launches_vllm(self.cfg) else []
        for name, module, extra, env in placement(self.cfg):
            if name.startswith("learner") and self.resume:
                extra = [*extra, "--resume"]
            if name.startswith("rollout-") and urls:  # its own server; the server, not the daemon, takes its GPUs
                i = int(name.split("-")[1])
                extra, env = [*extra, f"rollout.vllm.urls=[{urls[i]}]"], {}
            self._start(name, module, extra, env)

    def _start_vllm(self) -> list[str]:
        """One vLLM server per rollout daemon (logs/vllm-<i>.log), on the daemon's GPUs; their URLs."""
        from offpolicy.engines.vllm.launch import initial_model, server_command, server_env, server_url

        import torch

        on_cpu = self.cfg.rollout.device == "cpu" or not torch.cuda.is_available()
        model = initial_model(self.cfg, self.dir)
        rollouts = {name: env for name, _, _, env in placement(self.cfg) if name.startswith("rollout-")}
        for i in range(self.cfg.run.rollouts):
            self._spawn(f"vllm-{i}", server_command(self.cfg, model, i, on_cpu),
                        {**server_env(), **rollouts[f"rollout-{i}"]})
        return [server_url(self.cfg, i) for i in range(self.cfg.run.rollouts)]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every daemon still running (learner first), then SIGKILL what outlives `timeout`.
        Learner worker ranks follow rank 0's stop command; they get SIGTERM only if they outlive it."""
        workers = {n for n in self.procs if n.startswith("learner-r")}
        for phase in ([n for n in self.procs if n not in workers], sorted(workers)):
            for n in phase:
                if self.procs[n].poll() is None:
                    self.procs[n].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for n in phase:
                p = self.procs[n]
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def failed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() not in (None, 0)]

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait(self, progress) -> int:
        """Follow the run until the learner exits; returns the learner's exit code. A daemon that exits
        with an error is reported at once with its log's end; the run stops when the learner (or one of
        its worker ranks) fails or every rollout daemon has."""
        from offpolicy.services.progress import MetricsTail

        learner = self.procs["learner"]
        rollouts = [p for n, p in self.procs.items() if n.startswith("rollout-")]
        tail = MetricsTail(self.dir / "metrics.jsonl")
        while learner.poll() is None:
            for row in tail.rows():
                progress.update(row)
            for name in self.failed():
                if name not in self.reported:
                    self.report_exit(name)
                if name.startswith("learner-r"):
                    return 1  # rank 0 cannot train without its worker ranks
            if rollouts and all(p.poll() not in (None, 0) for p in rollouts):
                progress.message("every rollout daemon exited with an error; stopping the learner")
                return 1
            time.sleep(0.2)
        for row in tail.rows():
            progress.update(row)
        if learner.returncode != 0:
            self.report_exit("learner")
            return learner.returncode if learner.returncode > 0 else 128 - learner.returncode  # as a shell does
        for p in rollouts:  # they leave on the learner's Goodbye
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.wait_eval(progress)
        return 0

    def report_exit(self, name: str) -> None:
        """Say on stderr, now, that daemon `name` exited with an error, with its log's end."""
        self.reported.add(name)
        code = self.procs[name].returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"\n{name} {how}; its log ({self.dir / 'logs' / (name + '.log')}) ends:\n{self.log_tail(name)}",
              file=sys.stderr, flush=True)

    def wait_eval(self, progress) -> None:
        """The eval daemon finishes the versions it holds after the learner's Goodbye: up to eval.finish_timeout_s."""
        proc = self.procs.get("eval")
        if proc is None or proc.poll() is not None:
            return
        progress.message(f"training done; waiting up to {self.cfg.eval.finish_timeout_s:.0f} s (eval.finish_timeout_s) "
                         f"for the eval daemon's last versions (see {self.dir / 'eval.jsonl'})")
        try:
            proc.wait(self.cfg.eval.finish_timeout_s)
        except subprocess.TimeoutExpired:
            progress.message("the eval daemon is still evaluating: stopping it (its results resume with --resume)")


def launch(config_path: str | None, overrides: list[str], cfg: Config, resume: bool = False) -> int:
    from offpolicy import preflight, runlock
    from offpolicy.config import ConfigError

    try:  # a live run of this name, a missing model, nothing to resume: refused before anything changes
        runlock.probe(cfg)
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
    if launches_vllm(cfg) and cfg.rollout.weights_format != "native":
        import torch

        if cfg.rollout.device == "cpu" or not torch.cuda.is_available():
            print(f"error: config field rollout.weights_format: is {cfg.rollout.weights_format}, but vLLM on a CPU "
                  "runs native weights only (docs/vllm.md); use rollout.weights_format=native, or GPUs",
                  file=sys.stderr)
            return 2
    from offpolicy.services.progress import Progress

    launcher = Launcher(config_path, overrides, cfg, resume)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.time()
    gpus = (f" (learner GPUs {cfg.run.learner_gpus or 'inherited'}, rollout GPUs "
            f"{cfg.run.rollout_gpus or 'inherited'})") if cfg.run.learner_gpus or cfg.run.rollout_gpus else ""
    servers = f" + {cfg.run.rollouts} vLLM servers" if launches_vllm(cfg) else ""
    print(f"offpolicy run {cfg.run.name}: 1 learner + {cfg.run.rollouts} rollout daemons{servers}{gpus}; "
          f"run directory {launcher.dir}", flush=True)
    launcher.start()
    code = 1
    try:
        with Progress(cfg) as progress:
            code = launcher.wait(progress)
    except KeyboardInterrupt:
        print("\nstopping: SIGTERM to every daemon ...", file=sys.stderr)
        code = 130
    finally:
        launcher.stop()
    for name in launcher.failed():
        if name not in launcher.reported:
            launcher.report_exit(name)
    if not cfg.weights.keep_after_run:
        _free_store(cfg)
    return _report(launcher.dir, code, time.time() - t0)


def _free_store(cfg: Config) -> None:
    """The retention policy: the run's weight store leaves /dev/shm with the launcher (docs/operations.md)."""
    from offpolicy import stores

    try:
        size = stores.free(cfg.weights.root, cfg.run.name)
    except FileNotFoundError:
        return
    except stores.StoreLive as e:  # a learner outlived the launcher's stop
        print(f"kept the weight store: {e}", file=sys.stderr)
        return
    print(f"freed the weight store {cfg.weights.root}/{cfg.run.name} ({size / 2**20:,.1f} MiB; "
          "weights.keep_after_run=true keeps it)")


def _report(run_dir: Path, code: int, wall: float) -> int:
    summary_path = run_dir / "summary.json"
    if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size:
        from offpolicy.plot import plot_rewards

        print(f"reward curve: {plot_rewards(run_dir)}")
    _report_eval(run_dir)
    if not summary_path.exists():
        print(f"no summary.json in {run_dir}: the learner did not finish (see {run_dir}/logs)", file=sys.stderr)
        return code or 1
    summary = json.loads(summary_path.read_text())
    summary["launcher_wall_seconds"] = round(wall, 2)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    keys = ("steps", "wall_seconds", "initial_reward_mean", "final_reward_mean", "max_staleness_seen",
            "prompts_lost", "prompts_duplicated", "groups_dropped_stale", "tokens_per_s")
    width = max(map(len, keys))
    print("\n".join(f"  {k:<{width}}  {summary.get(k)}" for k in keys))
    print(f"summary: {summary_path}")
    return code


def _report_eval(run_dir: Path) -> None:
    from offpolicy.runlog import read_jsonl

    rows = read_jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").exists() else []
    done = [r for r in rows if "pass_at_k" in r]
    if not done:
        return
    from offpolicy.plot import plot_eval

    last = max(done, key=lambda r: r["version"])
    skipped = [r["version"] for r in rows if "skipped" in r]
    print(f"eval: {len(done)} versions evaluated{f', skipped {skipped}' if skipped else ''}; version {last['version']}: "
          + ", ".join(f"pass@{k} {v:.3f}" for k, v in last["pass_at_k"].items())
          + f"; pass@k curve: {plot_eval(run_dir)}")


def main(args) -> int:
    from offpolicy.services.args import resolve

    cfg = resolve(args)
    return launch(args.config, args.overrides, cfg, resume=args.resume)
