"""The processes `offpolicy run` started, watched: a death is noticed, its group killed, the process restarted.

`Supervisor` owns every daemon and server of a run (offpolicy/launch/run.py says which). Each is started in a
session of its own (its pid is its process group: vLLM's EngineCore and workers join it) with the parent-
death signal, and its group is handed to the orphan reaper (offpolicy/launch/reaper.py), so nothing outlives the
launcher even when the launcher is SIGKILLed. `deaths()` returns the processes that exited since the last
call; for each, the launcher either calls `schedule` (a restart after the policy's backoff,
offpolicy/plumbing/restarts.py), which buries the rest of its group in the background (SIGTERM, SIGKILL after
run.supervise.kill_grace_s) so that the supervision loop never waits on a kill, or `bury` (the same, waited for)
and stops the run. The processes of one restart unit (the learner's ranks) go and
come back together. `stop()` ends everything: SIGTERM to each phase at once, SIGKILL after a timeout, then
every group at once (a vLLM server with its group after kill_grace_s already), and says what each took
(`StopReport`). Invariants: a group is killed before its process is started again; a restarted
process appends to its log after a line saying which restart it is; every group the supervisor started is
listed with the reaper until it is gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from offpolicy.config import SuperviseConfig
from offpolicy.launch.spare import warmable
from offpolicy.plumbing.lifetime import die_with_parent, kill_group, kill_groups
from offpolicy.plumbing.restarts import Decision, RestartPolicy

SPARES_LOST_MAX = 3  # spares of one environment that may exit unused before its restarts start cold for good


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
    warm: bool = False  # the last start took over a warm spare (offpolicy/launch/spare.py)
    spare_warming: bool = False  # the last restart started cold: the spare of its environment was still warming up
    finished: bool = False  # exited and not to be restarted (done, or given up)
    buried: set[int] = field(default_factory=set)  # pids whose group was killed already
    burial: threading.Thread | None = None  # the background kill of the last pid's group (`schedule`)

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class StopReport:
    """What `Supervisor.stop` took: each stopped process's exit after its SIGTERM, the groups' burial after."""
    exits: dict[str, float] = field(default_factory=dict)  # name -> seconds from its SIGTERM to its exit
    killed: list[str] = field(default_factory=list)  # processes SIGKILLed at the stop's timeout
    groups_s: float = 0.0  # the burial of every group (what the processes left behind) at once
    groups_killed: list[str] = field(default_factory=list)  # whose group had to be SIGKILLed after kill_grace_s
    whole_killed: list[str] = field(default_factory=list)  # `quick` ones SIGKILLed with their group after kill_grace_s
    seconds: float = 0.0  # the whole stop, the reaper's exit included

    def line(self) -> str:
        """One console line: the total, each process, and anything that had to be SIGKILLed."""
        each = ", ".join(f"{n} {s:.1f} s" for n, s in sorted(self.exits.items(), key=lambda e: -e[1]))
        kills = [f"SIGKILL to {', '.join(self.killed)} (past the stop's timeout)"] if self.killed else []
        if self.whole_killed:
            kills.append(f"SIGKILL to {', '.join(self.whole_killed)} with its process group (past "
                         "run.supervise.kill_grace_s)")
        if self.groups_killed:
            kills.append(f"SIGKILL to what {', '.join(self.groups_killed)} left in its process group "
                         "(past run.supervise.kill_grace_s)")
        return (f"stopped in {self.seconds:.1f} s (after SIGTERM: {each or 'nothing was running'}; their process "
                f"groups {self.groups_s:.1f} s)" + (f"; {'; '.join(kills)}" if kills else ""))


class Supervisor:
    def __init__(self, cfg: SuperviseConfig, log_dir: Path, append_logs: bool = False):
        self.cfg, self.log_dir, self.append_logs = cfg, log_dir, append_logs
        self.policy = RestartPolicy(cfg)
        self.procs: dict[str, Proc] = {}
        self.reaper = subprocess.Popen([sys.executable, "-m", "offpolicy.launch.reaper"], stdin=subprocess.PIPE,
                                       start_new_session=True)
        self._reaper_lock = threading.Lock()
        self.spares: dict[tuple, subprocess.Popen] = {}  # warm spares (offpolicy/launch/spare.py) by environment
        self.ready: set[int] = set()  # pids of the spares that said they are warm
        self.nice: dict[int, int] = {}  # pid of a spare -> the niceness it warms up at
        self.spares_lost: dict[tuple, int] = {}  # spares that exited unused, by environment (SPARES_LOST_MAX: no more)
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
            spare = self.spares.get(self._spare_key(proc)) if proc.restarts else None
            # a spare still warming up at a niceness of its own would start the daemon only once it is done
            usable = spare is not None and (self.nice.get(spare.pid, 0) == 0 or self.spare_ready(spare))
            if usable:
                del self.spares[self._spare_key(proc)]
            proc.warm = usable and self._hand_over(spare, proc, log.name)  # warm: its imports are done
            proc.spare_warming = spare is not None and not usable and spare.poll() is None
            if proc.spare_warming:  # the run lost a process: the spare that replaces this one gets the run's priority
                self._retire(self._spare_key(proc))
            if proc.warm:
                proc.popen = spare
            else:
                proc.popen = subprocess.Popen(proc.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=die_with_parent(signal.SIGTERM),
                                              env={**os.environ, **proc.env} if proc.env else None)
                self._tell_reaper(f"+{proc.popen.pid}")
        proc.started, proc.started_wall, proc.restart_at, proc.finished = time.monotonic(), time.time(), None, False

    def _hand_over(self, spare: subprocess.Popen, proc: Proc, log: str) -> bool:
        """Tell a spare to become `proc` (its arguments, its log); False if the spare is gone."""
        spare.stdout.close()  # its `ready` is heard or no longer needed
        try:
            spare.stdin.write((json.dumps({"module": proc.cmd[2], "args": proc.cmd[3:], "log": log}) + "\n").encode())
            spare.stdin.close()
        except (BrokenPipeError, ValueError):
            return False
        return spare.poll() is None

    def _retire(self, key: tuple) -> None:
        """A niced spare still warming up goes (SIGKILL: it holds nothing yet), so that `keep_spares` replaces it."""
        spare = self.spares.pop(key)
        spare.kill()
        spare.wait()
        self._forget(spare)

    def _forget(self, spare: subprocess.Popen) -> None:
        """A spare that is gone: its pipes closed, the reaper told, nothing kept about it."""
        spare.stdin.close()
        spare.stdout.close()
        self._tell_reaper(f"-{spare.pid}")
        self.ready.discard(spare.pid)
        self.nice.pop(spare.pid, None)

    def any_restarts(self) -> bool:
        return any(p.restarts for p in self.procs.values())

    def spare_ready(self, spare: subprocess.Popen) -> bool:
        """Whether `spare` has said `ready` (its imports are done), without waiting."""
        if spare.pid not in self.ready and not spare.stdout.closed and \
                select.select([spare.stdout], [], [], 0)[0] and spare.stdout.readline() == b"ready\n":
            self.ready.add(spare.pid)
        return spare.pid in self.ready and spare.poll() is None

    @staticmethod
    def _spare_key(proc: Proc) -> tuple:
        return tuple(sorted((proc.env or {}).items()))

    def keep_spares(self) -> None:
        """One warm spare (offpolicy/launch/spare.py) per environment of the processes that may be restarted (any
        daemon of spare.WARM: one spare serves the learner and the rollouts alike where they share an environment,
        as on a CPU machine), started where none is (`run.supervise.warm_spares`): at run.supervise.spare_nice
        while the run has lost no process, at niceness 0 after."""
        if not (self.cfg.warm_spares and self.cfg.restart):
            return
        for proc in self.procs.values():
            key = self._spare_key(proc)
            if proc.finished or not warmable(proc.cmd) or (key in self.spares and self.spares[key].poll() is None):
                continue
            if key in self.spares:  # it exited unused (its imports failed, or it was killed): not in a loop
                lost = self.spares_lost[key] = self.spares_lost.get(key, 0) + 1
                dead = self.spares.pop(key)
                self._forget(dead)
                if lost == SPARES_LOST_MAX:
                    print(f"warm spares: {lost} spares exited unused (the last with code {dead.returncode}); the "
                          f"restarts of {proc.name} and its like start cold from now on (run.supervise.warm_spares)",
                          file=sys.stderr, flush=True)
            if self.spares_lost.get(key, 0) >= SPARES_LOST_MAX:
                continue
            if self.policy.left(proc.unit, time.monotonic()) == 0 or len(self.unit(proc.unit)) > 1:
                continue  # no restart left, or a unit of several ranks (they start together, cold)
            # the run's first spare takes only the CPU the run leaves; once the run lost a process (the kind of run
            # likely to lose another), the one that replaces a spare taken warms up at the run's priority
            nice = 0 if self.any_restarts() else self.cfg.spare_nice
            spare = subprocess.Popen([sys.executable, "-m", "offpolicy.launch.spare", str(nice)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True,
                                     preexec_fn=die_with_parent(signal.SIGTERM),
                                     env={**os.environ, **proc.env} if proc.env else None)
            self.spares[key] = spare
            self.nice[spare.pid] = nice
            self._tell_reaper(f"+{spare.pid}")

    def _end_spares(self) -> list[int]:
        """Unused spares go (the end of their pipe, and SIGTERM); their pids, whose groups are to be buried."""
        pids = []
        for spare in self.spares.values():
            try:
                spare.stdin.close()
                spare.stdout.close()
            except OSError:
                pass
            if spare.poll() is None:
                spare.send_signal(signal.SIGTERM)
            pids.append(spare.pid)
        return pids

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

    def decide(self, unit: str, proven: bool = False) -> Decision:
        return self.policy.decide(unit, time.monotonic(), proven)

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

    def stop(self, order: list[list[str]], timeout: float = 30.0,
             quick: frozenset[str] = frozenset()) -> StopReport:
        """SIGTERM each phase's running processes at once and wait for them together, up to `timeout`, SIGKILL
        what is left; then every group goes at once (a process's children too: SIGTERM, SIGKILL after
        kill_grace_s) and the reaper is let go. The processes named in `quick` (vLLM servers: they hold nothing a
        run needs, and one still starting up leaves its SIGTERM unanswered for long) get SIGKILL with their whole
        group after kill_grace_s instead of `timeout`. Nothing is restarted any more. Returns what the stop took."""
        t0 = time.monotonic()
        report = StopReport()
        for p in self.procs.values():
            p.restart_at = None
        for phase in order:
            procs = [self.procs[n] for n in phase if n in self.procs and self.procs[n].running()]
            began = time.monotonic()
            for p in procs:
                p.popen.send_signal(signal.SIGTERM)
            deadline = began + timeout
            while procs and time.monotonic() < deadline:
                for p in [p for p in procs if p.popen.poll() is not None]:
                    report.exits[p.name] = time.monotonic() - began
                    procs.remove(p)
                if time.monotonic() - began >= self.cfg.kill_grace_s:
                    for p in [p for p in procs if p.name in quick]:  # the group at once: its leader coordinates it
                        try:
                            os.killpg(p.popen.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        p.popen.wait()
                        report.exits[p.name] = time.monotonic() - began
                        report.whole_killed.append(p.name)
                        procs.remove(p)
                if procs:
                    time.sleep(0.02)
            for p in procs:  # past the timeout
                p.popen.kill()
                p.popen.wait()
                report.exits[p.name] = time.monotonic() - began
                report.killed.append(p.name)
        for p in self.procs.values():  # a background burial (a restart's) finishes first
            if p.burial is not None:
                p.burial.join()
        left = [p for p in self.procs.values() if p.popen is not None and p.popen.pid not in p.buried]
        spares = self._end_spares()
        began = time.monotonic()
        killed = kill_groups({p.popen.pid for p in left} | set(spares), self.cfg.kill_grace_s)
        report.groups_s = time.monotonic() - began
        report.groups_killed = sorted(p.name for p in left if p.popen.pid in killed)
        for p in left:
            p.popen.wait()
            p.buried.add(p.popen.pid)
            self._tell_reaper(f"-{p.popen.pid}")
            if self.after_bury is not None:
                self.after_bury(p)
        for spare in self.spares.values():
            spare.wait()
            self._tell_reaper(f"-{spare.pid}")
        self.spares.clear()
        for p in self.procs.values():
            p.finished = True
        self.close()
        report.seconds = time.monotonic() - t0
        return report

    def close(self) -> None:
        with self._reaper_lock:
            if self.reaper.stdin is not None and not self.reaper.stdin.closed:
                self.reaper.stdin.close()
        try:
            self.reaper.wait(10)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
