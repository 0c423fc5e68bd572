"""What an operator does to a run, against real daemons (issue 26): a second learner on a live run, a
SIGKILLed learner and `offpolicy run --resume`, a dead rollout daemon, freeing weight stores.
The entry points' one-line errors are in test_entry_errors.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from offpolicy.plumbing.runlock import holder
from offpolicy.weights import list_versions
from tests.conftest import QUICKSTART, daemon_cmd
from tests.integration.helpers import check_run_invariants, cmdline, read_jsonl, wait_for

FOREVER = "learner.total_steps=100000"  # a run that goes on until it is stopped


class Launcher:
    """`offpolicy run QUICKSTART` in the background, its stdout and stderr in files."""

    def __init__(self, overrides, *extra: str, tmp: Path, tag: str = "run"):
        self.out, self.err = tmp / f"{tag}.out", tmp / f"{tag}.err"
        cmd = [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *overrides, *extra]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err)

    def stderr(self) -> str:
        return self.err.read_text()

    def daemon(self, index_arg: str) -> psutil.Process:
        """The child daemon whose command line holds `index_arg` (e.g. "offpolicy.services.learner")."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        return next(k for k in kids if index_arg in cmdline(k))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def root_of(overrides) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("weights.root="))


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The entry point failed as it must on bad input: exit code 2, one `error:` line, no traceback."""
    err = res.stderr.strip()
    assert res.returncode == 2 and err.startswith("error: ") and "\n" not in err, (res.returncode, res.stderr)
    return err


def test_a_second_learner_or_launcher_leaves_a_live_run_untouched(run_overrides, tmp_path):
    run_dir, root = run_overrides.run_dir / "quickstart", root_of(run_overrides)
    live = Launcher(run_overrides, FOREVER, tmp=tmp_path)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 3, 180, "the live run's first steps")
        owner = holder(run_overrides.run_dir / ".quickstart.lock")
        assert owner is not None and owner["pid"] == live.daemon("offpolicy.services.learner").pid
        before = list_versions(root, "quickstart")
        for cmd in (daemon_cmd("learner", "--config", QUICKSTART, *run_overrides),
                    daemon_cmd("learner", "--config", QUICKSTART, *run_overrides, "--resume"),
                    [sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *run_overrides]):
            err = one_error_line(subprocess.run(cmd, capture_output=True, text=True, timeout=60))
            assert "run 'quickstart' is live" in err and f"pid {owner['pid']}" in err and "run.name" in err
        # nothing moved aside, nothing deleted: the live run goes on in its own directory and store
        assert sorted(p.name for p in run_overrides.run_dir.iterdir() if not p.name.startswith(".")) == ["quickstart"]
        assert list_versions(root, "quickstart") and max(list_versions(root, "quickstart")) >= max(before)
        n = steps_logged(run_dir)
        wait_for(lambda: steps_logged(run_dir) >= n + 3, 120, "the live run's next steps")
        # `offpolicy stores` will not free the live store either
        stores = [sys.executable, "-m", "offpolicy.services.cli", "stores", "--config", QUICKSTART, *run_overrides]
        listing = subprocess.run(stores, capture_output=True, text=True, timeout=60)
        assert listing.returncode == 0 and "quickstart" in listing.stdout and f"live: pid {owner['pid']}" in listing.stdout
        err = one_error_line(subprocess.run([*stores, "--free", "quickstart"], capture_output=True, text=True, timeout=60))
        assert "is live" in err
        free_all = subprocess.run([*stores, "--free-all"], capture_output=True, text=True, timeout=60)
        assert free_all.returncode == 0 and "no store to free" in free_all.stdout
        assert list_versions(root, "quickstart")
    finally:
        code = live.stop()
    assert code == 130, live.stderr()  # stopped by SIGTERM: the learner checkpoints and writes its summary
    assert (run_dir / "summary.json").exists() and (run_dir / "checkpoints").is_dir()
    check_run_invariants(run_dir, 1)
    # the retention policy: the launcher freed the run's store on its way out
    assert not (Path(root) / "quickstart").exists()
    assert "freed the weight store" in live.out.read_text()


@pytest.mark.slow  # a run killed and resumed (~35 s); a dead rollout daemon is reported in the default suite
def test_sigkilled_learner_is_reported_at_once_and_resume_finishes(run_overrides, tmp_path):
    """The learner dies (SIGKILL) with metrics.jsonl past its last checkpoint: the launcher says so with the
    log's end within 5 s; `offpolicy run --resume` (which cuts metrics.jsonl back while the launcher follows
    it) is one command that finishes, every prompt trained once."""
    run_dir = run_overrides.run_dir / "quickstart"
    run = Launcher(run_overrides, FOREVER, "checkpoint.every_steps=5", "run.supervise.restart=false", tmp=tmp_path)
    learner = None
    try:
        wait_for(lambda: steps_logged(run_dir) >= 7, 180, "7 steps")
        learner = run.daemon("offpolicy.services.learner")
        for _ in range(200):  # stop it where metrics.jsonl runs past the newest checkpoint
            learner.suspend()
            if steps_logged(run_dir) % 5:
                break
            learner.resume()
            time.sleep(0.05)
        logged = steps_logged(run_dir)
        learner.kill()
        t0 = time.monotonic()
        wait_for(lambda: re.search(r"learner \(pid \d+\) was killed by SIGKILL", run.stderr()), 5,
                 "the launcher's report of the death")
        reported = time.monotonic() - t0
        code = run.proc.wait(30)
        print(f"learner death reported after {reported:.2f} s, launcher exited after {time.monotonic() - t0:.2f} s")
    finally:
        run.stop()
    assert code == 128 + signal.SIGKILL, run.stderr()  # as a shell reports a death by signal
    assert "its log" in run.stderr() and "learner.log" in run.stderr()
    checkpointed = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").iterdir()
                       if p.name.startswith("step-"))
    assert logged > checkpointed, (logged, checkpointed)  # the resume must cut metrics.jsonl back
    total = checkpointed + 6
    resumed = subprocess.run([sys.executable, "-m", "offpolicy.services.cli", "run", QUICKSTART, *run_overrides,
                              "--resume", f"learner.total_steps={total}"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "Traceback" not in resumed.stderr
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == total
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(total))


def test_a_dead_rollout_daemon_is_reported_at_once_and_the_run_goes_on_and_its_kept_store_is_freed_by_command(
        run_overrides, tmp_path):
    """With restarts off (run.supervise.restart=false) a dead rollout daemon is reported with its log's end and
    the run goes on with the other; restarts are test_supervision.py's. The same run keeps its store
    (weights.keep_after_run=true): it outlives the launcher, `offpolicy stores` lists it and frees it by name
    (that a store not kept is freed at the end: test_a_second_learner_or_launcher_leaves_a_live_run_untouched)."""
    run_dir, root = run_overrides.run_dir / "quickstart", root_of(run_overrides)
    run = Launcher(run_overrides, "learner.total_steps=15", "run.supervise.restart=false",
                   "weights.keep_after_run=true", tmp=tmp_path)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 2, 180, "the first steps")
        run.daemon("--index 0").kill()
        t0 = time.monotonic()
        wait_for(lambda: re.search(r"rollout-0 \(pid \d+\) was killed by SIGKILL", run.stderr()), 5,
                 "the launcher's report of the death")
        print(f"rollout death reported after {time.monotonic() - t0:.2f} s")
        code = run.proc.wait(240)
    finally:
        run.stop()
    assert code == 0, run.stderr()
    assert run.stderr().count("rollout-0 (pid") == 1 and "not restarted" in run.stderr()  # reported once, at once
    summary = check_run_invariants(run_dir, 1)
    assert summary["steps"] == 15  # most of them (13 or more) trained after the kill, by rollout-1 alone

    assert list_versions(root, "quickstart") == [13, 14, 15]  # kept after the run: its newest weights.keep versions
    cli = [sys.executable, "-m", "offpolicy.services.cli"]
    listing = subprocess.run([*cli, "stores", "--root", root], capture_output=True, text=True, timeout=60)
    assert "quickstart" in listing.stdout and "v13..v15 (3)" in listing.stdout and "can be freed" in listing.stdout
    err = one_error_line(subprocess.run([*cli, "stores", "--root", root, "--free", "nope"], capture_output=True,
                                        text=True, timeout=60))
    assert "no store 'nope'" in err
    freed = subprocess.run([*cli, "stores", "--root", root, "--free", "quickstart"], capture_output=True, text=True,
                           timeout=60)
    assert freed.returncode == 0 and f"freed {root}/quickstart" in freed.stdout
    assert not os.path.exists(f"{root}/quickstart")
