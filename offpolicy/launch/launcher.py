"""`Launcher`: the processes of one `offpolicy run`, started, followed, supervised and stopped.

`start` launches the vLLM or SGLang servers (rollout.<engine>.mode http without urls: one per rollout daemon), then
the daemons of `placement` through a `Supervisor` (offpolicy/launch/supervisor.py: own process groups, parent-death
signal, the orphan reaper). `wait` follows the run until the learner finishes, showing progress from
metrics.jsonl, and handles every unexpected exit on its own console line (what died, how, what is done):
- the learner (or one of its Megatron ranks): all its ranks go and come back with `--resume` from the
  newest checkpoint; with no checkpoint yet the run stops, saying so;
- a rollout daemon, a vLLM or SGLang server, the eval daemon: its process group goes, it comes back;
each after the restart policy's backoff (none for a process the run trained a step with since its start),
within its budget (run.supervise, offpolicy/plumbing/restarts.py); a
death past the budget stops the run (code 1, or the learner's own code), and `run.supervise.restart=false`
restores plain reporting: a dead daemon is reported with its log's end and the run goes on while it can.
A rollout or eval daemon that exits 0 once the learner has logged its last step left on the learner's
Goodbye; before that, any exit is unexpected (a stop request to one daemon included: stop the launcher
to stop the run). A run with no training step for stall_timeout_s says
so with the cause it sees (offpolicy/launch/stall.py). Its figures are served on `launcher_metrics_port`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from offpolicy.config import Config, ConfigError
from offpolicy.launch.chaos import Chaos
from offpolicy.launch.placement import is_server, launched_servers, launcher_metrics_port, placement
from offpolicy.launch.stall import StallWatch, last_warning
from offpolicy.launch.supervisor import Proc, StopReport, Supervisor, how
from offpolicy.plumbing.metrics import LauncherMetrics, serve

# seconds the rollouts together get to leave on the learner's Goodbye before the launcher's stop SIGTERMs the rest
# (a rollout restarted as the learner finished hears no Goodbye: it waited its 30 s before)
GOODBYE_S = 5.0


def exit_code(code: int) -> int:
    """A process's exit status as a shell reports it (a death by signal N: 128 + N)."""
    return code if code >= 0 else 128 - code


def rollout_servers(cfg: Config, model_dir: Path) -> list[tuple[str, list[str], dict[str, str], str]]:
    """The vLLM or SGLang servers a run launches (`placement.launched_servers`: rollout.<engine>.mode http, no urls):
    one per rollout daemon, on the daemon's GPUs, started from the initial model (made under `model_dir`):
    (name <engine>-<i>, command, environment beside the launcher's own, URL). The launcher supervises them;
    `offpolicy bench pipeline` starts them once for its runs."""
    from offpolicy.rollout.engines.launch import initial_model

    engine = launched_servers(cfg)
    model = initial_model(cfg, model_dir, engine)
    rollouts = {name: env for name, _, _, env in placement(cfg) if name.startswith("rollout-")}
    if engine == "sglang":
        from offpolicy.rollout.engines.sglang import launch as sglang

        return [(f"sglang-{i}", sglang.server_command(cfg, model, i), rollouts[f"rollout-{i}"],
                 sglang.server_url(cfg, i)) for i in range(cfg.run.rollouts)]
    import torch

    from offpolicy.rollout.engines.vllm.launch import server_command, server_env, server_url

    on_cpu = cfg.rollout.device == "cpu" or not torch.cuda.is_available()
    return [(f"vllm-{i}", server_command(cfg, model, i, on_cpu), {**server_env(), **rollouts[f"rollout-{i}"]},
             server_url(cfg, i)) for i in range(cfg.run.rollouts)]


class Launcher:
    def __init__(self, config_path: str | None, overrides: list[str], cfg: Config, resume: bool = False,
                 servers: list[str] | None = None):
        """`servers`: the URLs of vLLM or SGLang servers the caller started, one per rollout daemon in order, which a
        run that would launch its own (rollout.<engine>.mode http, no urls) uses instead (`offpolicy bench pipeline`
        starts them once for all its runs); they are not the run's to stop."""
        from offpolicy.loggers.runlog import prepare_run_dir, run_path

        self.config_path, self.overrides, self.cfg, self.resume = config_path, overrides, cfg, resume
        self.servers = servers
        self.dir = run_path(cfg) if resume else prepare_run_dir(run_path(cfg))
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.sup: Supervisor | None = None
        self.metrics = LauncherMetrics()
        self.reported: set[str] = set()  # daemons whose failure was reported with their log's end
        self.last_step = -1  # the newest training step metrics.jsonl showed
        self.step_seen: dict[int, float] = {}  # step -> when the launcher first saw it (monotonic)
        self.progress_at = float("-inf")  # when the launcher last saw the learner log a step (a redone one too)
        self.chaos: Chaos | None = None  # run.chaos, made when the run is followed (`wait`)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {n: p.popen for n, p in self.sup.procs.items() if p.popen is not None} if self.sup else {}

    def _cmd(self, module: str, extra: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", module]
        if self.config_path:
            cmd += ["--config", self.config_path]
        return [*cmd, *self.overrides, *extra]

    def start(self) -> None:
        self.sup = Supervisor(self.cfg.run.supervise, self.dir / "logs", append_logs=self.resume)
        self.sup.after_bury = self._clear_leftovers
        serve(self.metrics.registry, launcher_metrics_port(self.cfg), self.cfg.metrics.host)
        engine = launched_servers(self.cfg)
        urls = (self.servers or self._start_servers()) if engine else []
        for name, module, extra, env in placement(self.cfg):
            if name.startswith("learner") and self.resume:
                extra = [*extra, "--resume"]
            if name.startswith("rollout-") and urls:  # its own server; the server, not the daemon, takes its GPUs
                i = int(name.split("-")[1])
                extra, env = [*extra, f"rollout.{engine}.urls=[{urls[i]}]"], {}
            self.sup.add(name, self._cmd(module, extra), env, unit="learner" if name.startswith("learner") else None)

    def _start_servers(self) -> list[str]:
        """One server per rollout daemon (logs/<engine>-<i>.log), on the daemon's GPUs; their URLs."""
        servers = rollout_servers(self.cfg, self.dir)
        for name, cmd, env, _ in servers:
            self.sup.add(name, cmd, env)
        return [url for *_, url in servers]

    def stop(self, timeout: float = 30.0) -> StopReport | None:
        """SIGTERM every process still running (learner rank 0, rollouts, servers, eval) at once, SIGKILL what
        outlives `timeout`, then every whole group; what it took. Worker ranks follow rank 0's stop command; they
        get SIGTERM only if they outlive it. A vLLM or SGLang server that outlives run.supervise.kill_grace_s is
        SIGKILLed with its group then: it holds nothing of the run (what vLLM's EngineCore leaves in shared memory is
        removed after it), and one still starting up answers no SIGTERM for long."""
        if self.sup is None:
            return None
        workers = sorted(n for n in self.sup.procs if n.startswith("learner-r"))
        servers = frozenset(n for n in self.sup.procs if is_server(n))
        return self.sup.stop([[n for n in self.sup.procs if n not in workers], workers], timeout, servers)

    def failed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() not in (None, 0)]

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # --- following the run --------------------------------------------------------------------------

    def wait(self, progress) -> int:
        """Follow the run until the learner finishes (0) or the run must stop (its exit code)."""
        from offpolicy.launch.progress import MetricsTail

        self.tail = MetricsTail(self.dir / "metrics.jsonl")
        stall = StallWatch(self.cfg.run.supervise.stall_timeout_s, self.metrics, time.monotonic())
        self.chaos = Chaos(self.cfg.run.chaos, self.dir, time.monotonic(), self.cfg.learner.total_steps)
        learner = self.sup.procs["learner"]
        while not (learner.popen.poll() == 0 and learner.restart_at is None):
            rows = self._rows(progress)
            if rows and (msg := stall.step(time.monotonic())):
                progress.message(msg, err=True)
            if kill := self.chaos.tick(time.monotonic(), self.sup.procs, self.last_step + 1, self._resumable,
                                       lambda p: self.sup.policy.left(p.unit, time.monotonic()) > 0):
                progress.message(f"chaos: {kill['signal']} to {kill['name']} (pid {kill['pid']}) after {kill['steps']} "
                                 f"steps (kill {kill['kill']}; run.chaos)", err=True)
            for proc in self.sup.deaths():
                code = self._on_death(proc, progress)
                if code is not None:
                    return code
            for proc in self.sup.due():
                warm = ", from a warm spare" if proc.warm else ""
                cold = (f"; cold: the spare was still warming up at run.supervise.spare_nice="
                        f"{self.cfg.run.supervise.spare_nice}, the next one warms up at the run's priority"
                        if proc.spare_warming else "")
                progress.message(f"{proc.name} restarted (pid {proc.pid}{warm}; restart {proc.restarts} in this run{cold})",
                                 err=True)
            # the first spare, niced, takes only the CPU the run leaves: from the start; spares at the run's priority
            # (run.supervise.spare_nice=0, or once the run lost a process) only once the run trains with every
            # process up, not while they start
            if (self.cfg.run.supervise.spare_nice and not self.sup.any_restarts()) or \
                    all(p.started < self.progress_at for p in self.sup.procs.values() if p.running()):
                self.sup.keep_spares()
            if msg := stall.check(time.monotonic(), self._cause):
                progress.message(msg, err=True)
            for name, p in self.sup.procs.items():
                self.metrics.up.labels(name).set(1 if p.running() else 0)
            time.sleep(0.2)
        self._rows(progress)
        # the rollouts leave on the learner's Goodbye, within a second; one that did not hear it (restarted as the
        # learner finished, it connects to no one) is left to the stop that follows, not waited for
        deadline = time.monotonic() + GOODBYE_S
        for p in self.sup.procs.values():
            if p.name.startswith("rollout-") and p.popen is not None:
                try:
                    p.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.wait_eval(progress)
        return 0

    def _rows(self, progress) -> list[dict]:
        """The learner's new metrics.jsonl rows, shown; `last_step` follows them. A resumed learner rewrites the
        file from its checkpoint's step: the rows up to the newest step shown are not shown again."""
        rows = self.tail.rows()
        now = time.monotonic()
        if rows:
            self.progress_at = now
        fresh = []
        for row in rows:
            self.step_seen.setdefault(row["step"], now)  # a step redone after a resume keeps its first sighting
            if row["step"] <= self.last_step:  # a resumed learner rewrote metrics.jsonl: steps shown already
                continue
            progress.update(row)
            self.last_step = row["step"]
            fresh.append(row)
        return fresh

    def _clear_leftovers(self, proc: Proc) -> None:
        """A vLLM server's group is gone: the shared-memory segments its EngineCore made since it started and no
        live process maps are its leftovers (a SIGKILLed EngineCore cannot remove them); they go now."""
        if not proc.name.startswith("vllm-"):  # SGLang's servers keep their tensors' shared memory in live processes
            return
        from offpolicy.plumbing import segments

        freed = segments.remove_orphans(since=proc.started_wall)
        if freed:
            # since its start: its own, and those of a server that died after it started (no owner is recorded)
            print(f"{proc.name} gone: removed {freed / 2**20:,.1f} MiB of shared memory that SIGKILLed vLLM EngineCores "
                  "left behind", file=sys.stderr, flush=True)

    def _resumable(self) -> bool:
        """Whether a dead learner could resume now (a checkpoint exists): it is restarted, and chaos kills it, only
        then."""
        from offpolicy.plumbing import preflight

        try:
            preflight.check_resume(self.cfg)
        except ConfigError:
            return False
        return True

    def chaos_report(self) -> dict | None:
        """The chaos drill's cost (launch/chaos.py), written to <run dir>/chaos.json; None without kills."""
        if self.chaos is None or not self.chaos.kills:
            return None
        report = self.chaos.report(self.step_seen)
        (self.dir / "chaos.json").write_text(json.dumps(report, indent=1))
        return report

    def _on_death(self, proc: Proc, progress) -> int | None:
        """A supervised process exited: restart it (and its unit), or say why not; an exit code stops the run."""
        code = proc.popen.returncode
        if code == 0 and proc.name.startswith(("rollout-", "eval")):
            self._rows(progress)  # the learner logs its last step before its Goodbye: read up to it first
        if code == 0 and proc.name.startswith(("rollout-", "eval")) and \
                self.last_step + 1 >= self.cfg.learner.total_steps:
            proc.finished = True  # it left on the learner's Goodbye
            self.sup.bury(proc)
            return None
        self.metrics.exits.labels(proc.name, how(code).split()[-1]).inc()
        what = f"{proc.name} (pid {proc.pid}) {how(code)} after {time.monotonic() - proc.started:.0f} s"
        # the run trained a step since it (re)started: it got going, and is back at once (no backoff)
        decision = self.sup.decide(proc.unit, proven=self.progress_at > proc.started)
        if decision.allowed and proc.unit == "learner":
            if not self._resumable():
                self.report_exit(proc.name, f"{what}; it wrote no checkpoint yet, so there is nothing to resume it "
                                 "from: stopping the run (checkpoint.every_steps=N makes a dead learner resumable)")
                return exit_code(code) or 1
            for p in self.sup.unit("learner"):
                if "--resume" not in p.cmd:
                    p.cmd = [*p.cmd, "--resume"]
        if decision.allowed:
            s = self.cfg.run.supervise
            window = f" within {s.restart_window_s:.0f} s" if s.restart_window_s else ""
            whom = "every learner rank, from the newest checkpoint," if proc.unit == "learner" else "it"
            progress.message(f"{what}; restarting {whom} in {decision.delay_s:.0f} s, once its process group is gone "
                             f"(restart {decision.count} of "
                             f"run.supervise.max_restarts={s.max_restarts}{window})", err=True)
            self.sup.schedule(proc.unit, decision.delay_s)
            for p in self.sup.unit(proc.unit):
                self.metrics.restarts.labels(p.name).inc()
            return None
        self.sup.bury(proc)
        proc.finished = True
        learnerish = proc.unit == "learner"
        if self.cfg.run.supervise.restart:  # the budget is spent
            self.report_exit(proc.name, f"{what}; {decision.reason}: stopping the run")
            return exit_code(code) if learnerish and proc.name == "learner" else 1
        self.report_exit(proc.name, f"{what} (run.supervise.restart is false: not restarted)")
        if learnerish:
            return exit_code(code) if proc.name == "learner" else 1  # rank 0 cannot train without its workers
        rollouts = [p for n, p in self.sup.procs.items() if n.startswith("rollout-")]
        if all(p.popen.poll() not in (None, 0) for p in rollouts):
            progress.message("every rollout daemon exited with an error; stopping the learner", err=True)
            return 1
        return None

    def _cause(self) -> tuple[str, str]:
        """What the launcher sees of a stalled run: (offpolicy_launcher_stalled cause, a sentence)."""
        def state(p: Proc) -> str:
            if p.restart_at is not None:
                return f"{p.name} restarts in {max(0.0, p.restart_at - time.monotonic()):.0f} s"
            return f"{p.name} {how(p.popen.returncode)}" if p.popen is not None else f"{p.name} not started"

        learner = self.sup.unit("learner")
        if any(not p.running() for p in learner):
            return "learner_down", "the learner is down: " + ", ".join(state(p) for p in learner if not p.running())
        rollouts = [p for n, p in self.sup.procs.items() if n.startswith("rollout-")]
        if rollouts and all(not p.running() for p in rollouts):
            return "rollouts_down", "every rollout daemon is down: " + ", ".join(map(state, rollouts))
        servers = [p for n, p in self.sup.procs.items() if is_server(n)]
        if servers and all(not p.running() for p in servers):
            return "servers_down", "every rollout server is down: " + ", ".join(map(state, servers))
        notes = [f"{n}: {w}" for n in self.sup.procs if (w := last_warning(self.dir / "logs" / f"{n}.log"))]
        return "unknown", ("every process runs; their newest warnings: " + " | ".join(notes) if notes else
                           f"every process runs and none logged a warning (see {self.dir / 'logs'})")

    def report_exit(self, name: str, line: str | None = None) -> None:
        """Say on stderr, now, that daemon `name` exited (`line`, or how), with its log's end."""
        self.reported.add(name)
        if line is None:
            line = f"{name} {how(self.procs[name].returncode)}"
        print(f"\n{line}; its log ({self.dir / 'logs' / (name + '.log')}) ends:\n{self.log_tail(name)}",
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
