"""The processes `offpolicy run` started, watched: a death is noticed, its group killed, the process restarted.

`Supervisor` owns every daemon and server of a run (offpolicy/launch/run.py says which). Each is started in a
session of its own (its pid is its process group: vLLM's EngineCore and workers join it) with the parent-
death signal, and its group is handed to the orphan reaper (offpolicy/launch/reaper.py), so nothing outlives the
launcher even when the launcher is SIGKILLed. `deaths()` returns the processes that exited since the last
call; for each, the launcher either calls `schedule` (a restart after the policy's backoff,
offpolicy/plumbing/restarts.py), which buries the rest of its group in the background (SIGTERM, SIGKILL after
run.supervise.kill_grace_s) so that the supervision loop never waits on a kill, or `bury` (the same, waited for)
and stops the run. The processes of one restart unit (the learner's ranks) go and
come back together. `stop()` ends everything: SIGTERM in the given order, SIGKILL after a timeout, and the
whole group of each. Invariants: a group is killed before its process is started again; a restarted
process appends to its log after a line saying which restart it is; every group the supervisor started is
listed with the reaper until it is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from offpolicy.config import SuperviseConfig
from offpolicy.plumbing.lifetime import die_with_parent, kill_group
from offpolicy.plumbing.restarts import Decision, RestartPolicy


def how(code: int) -> str:
    """An exit status as a person says it: "was killed by SIGKILL" / "exited with code 3"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Proc:
    name: str  # "learner", "learner-r1", "rollout-0", "vllm-0", "eval"
    unit: str  # restart unit: the learner's ranks are all "learner"; otherwise the name
    cmd: list[str]
    env: dict[str, str] | None
    popen: subprocess.Popen | None = None
    started: float = 0.0  # monotonic time of the last start
    started_wall: float = 0.0  # the same as wall time (what it created since then is its own)
    restart_at: float | None = None  # a restart is scheduled for then
    restarts: int = 0  # restarts so far (the whole run)
    finished: bool = False  # exited and not to be restarted (done, or given up)
    buried: set[int] = field(default_factory=set)  # pids whose group was killed already
    burial: threading.Thread | None = None  # the background kill of the last pid's group (`schedule`)

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Supervisor:
    def __init__(self, cfg: SuperviseConfig, log_dir: Path, append_logs: bool = False):
        self.cfg, self.log_dir, self.append_logs = cfg, log_dir, append_logs
        self.policy = RestartPolicy(cfg)
        self.procs: dict[str, Proc] = {}
        self.reaper = subprocess.Popen([sys.executable, "-m", "offpolicy.launch.reaper"], stdin=subprocess.PIPE,
                                       start_new_session=True)
        self._reaper_lock = threading.Lock()
        self.after_bury = None  # called with each process once its group is gone (e.g. to clear what it left)

    def _tell_reaper(self, line: str) -> None:
        with self._reaper_lock:  # burials in the background tell it too
            if self.reaper.stdin is None or self.reaper.stdin.closed:
                return
            try:
                self.reaper.stdin.write(f"{line}\n".encode())
                self.reaper.stdin.flush()
            except BrokenPipeError:  # the reaper was killed: the parent-death signal still covers the daemons
                self.reaper.stdin = None

    # --- starting -----------------------------------------------------------------------------------

    def add(self, name: str, cmd: list[str], env: dict[str, str] | None, unit: str | None = None) -> Proc:
        """Start process `name` (its output to <log_dir>/<name>.log)."""
        proc = self.procs[name] = Proc(name, unit or name, cmd, env)
        self._start(proc, "a" if self.append_logs else "w")
        return proc

    def _start(self, proc: Proc, mode: str) -> None:
        with open(self.log_dir / f"{proc.name}.log", mode) as log:
            if proc.restarts:
                log.write(f"\n----- offpolicy run: restart {proc.restarts} of {proc.name} at "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')} -----\n")
                log.flush()
            proc.popen = subprocess.Popen(proc.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent(signal.SIGTERM),
                                          env={**os.environ, **proc.env} if proc.env else None)
        proc.started, proc.started_wall, proc.restart_at, proc.finished = time.monotonic(), time.time(), None, False
        self._tell_reaper(f"+{proc.popen.pid}")

    def unit(self, unit: str) -> list[Proc]:
        return [p for p in self.procs.values() if p.unit == unit]

    # --- deaths and restarts ------------------------------------------------------------------------

    def deaths(self) -> list[Proc]:
        """Processes that exited and were not looked at yet (not buried, nothing scheduled, not finished)."""
        return [p for p in self.procs.values() if p.popen is not None and p.popen.poll() is not None
                and p.popen.pid not in p.buried and p.restart_at is None and not p.finished and not self.burying(p)]

    @staticmethod
    def burying(proc: Proc) -> bool:
        return proc.burial is not None and proc.burial.is_alive()

    def bury(self, proc: Proc) -> None:
        """The rest of a dead (or to be restarted) process's group goes: SIGTERM, SIGKILL after kill_grace_s."""
        if proc.burial is not None and proc.burial is not threading.current_thread():
            proc.burial.join()  # a background burial of the same group first
        if proc.popen is None or proc.popen.pid in proc.buried:
            return
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(self.cfg.kill_grace_s)
            except subprocess.TimeoutExpired:
                pass
        kill_group(proc.popen.pid, self.cfg.kill_grace_s)
        proc.popen.wait()
        proc.buried.add(proc.popen.pid)
        self._tell_reaper(f"-{proc.popen.pid}")
        if self.after_bury is not None:
            self.after_bury(proc)

    def decide(self, unit: str) -> Decision:
        return self.policy.decide(unit, time.monotonic())

    def schedule(self, unit: str, delay_s: float) -> None:
        """Start every process of `unit` again in `delay_s`, each once its group is buried (in the background:
        a group that takes kill_grace_s to go never holds up the supervision of the others)."""
        for p in self.unit(unit):
            p.restart_at = time.monotonic() + delay_s
            if p.popen is not None and p.popen.pid not in p.buried and not self.burying(p):
                p.burial = threading.Thread(target=self.bury, args=(p,), name=f"bury-{p.name}", daemon=True)
                p.burial.start()

    def due(self) -> list[Proc]:
        """Start the processes whose restart is due and whose old group is gone; returns them."""
        now, started = time.monotonic(), []
        for p in self.procs.values():
            if p.restart_at is not None and p.restart_at <= now and not self.burying(p):
                p.restarts += 1
                self._start(p, "a")
                started.append(p)
        return started

    def down(self, name_prefix: str) -> list[Proc]:
        """Processes of that name prefix that are not running now (dead, or waiting for their restart)."""
        return [p for n, p in self.procs.items() if n.startswith(name_prefix) and not p.running()]

    # --- the end ------------------------------------------------------------------------------------

    def stop(self, order: list[list[str]], timeout: float = 30.0) -> None:
        """SIGTERM each phase's running processes, wait up to `timeout`, SIGKILL what is left; then every
        group goes (a process's children too) and the reaper is let go. Nothing is restarted any more."""
        for p in self.procs.values():
            p.restart_at = None
        for phase in order:
            procs = [self.procs[n] for n in phase if n in self.procs]
            for p in procs:
                if p.running():
                    p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in procs:
                if p.popen is None:
                    continue
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
        for p in self.procs.values():
            self.bury(p)
            p.finished = True
        self.close()

    def close(self) -> None:
        with self._reaper_lock:
            if self.reaper.stdin is not None and not self.reaper.stdin.closed:
                self.reaper.stdin.close()
        try:
            self.reaper.wait(10)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
