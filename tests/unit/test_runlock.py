"""The run lock: one owner at a time, released by the kernel when the owner dies, refusals name the holder."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from offpolicy.config import load_config
from offpolicy.plumbing import runlock
from tests.conftest import QUICKSTART


@pytest.fixture
def cfg(tmp_path):
    return load_config(QUICKSTART, [f"run.dir={tmp_path / 'runs'}", f"weights.root={tmp_path / 'shm'}"])


def test_one_owner_at_a_time(cfg):
    lock = runlock.acquire(cfg)
    for path in lock.paths:
        h = runlock.holder(path)
        assert h["pid"] == __import__("os").getpid() and h["run"] == "quickstart"
    with pytest.raises(runlock.RunBusy, match=r"run 'quickstart' is live: pid \d+ .* run.name=quickstart-2"):
        runlock.acquire(cfg)  # a second open file description: refused, as a second process is
    with pytest.raises(runlock.RunBusy):
        runlock.probe(cfg)
    lock.release()
    assert all(runlock.holder(p) is None for p in lock.paths)
    runlock.probe(cfg)
    runlock.acquire(cfg).release()


def test_the_store_lock_alone_is_enough_to_refuse(cfg):
    """A run directory elsewhere but the same store (weights.root/run.name): still refused."""
    import msgspec

    lock = runlock.acquire(cfg)
    other = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, dir=cfg.run.dir + "-elsewhere"))
    with pytest.raises(runlock.RunBusy, match="the lock of weights.root"):
        runlock.acquire(other)
    assert runlock.holder(runlock.lock_paths(other)["run.dir"]) is None  # the first lock was given back
    lock.release()


def test_a_killed_owner_leaves_no_stale_lock(cfg):
    code = ("import sys, time; from offpolicy.plumbing import runlock; from offpolicy.config import load_config; "
            f"lock = runlock.acquire(load_config({QUICKSTART!r}, sys.argv[1:])); print('held', flush=True); "
            "time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, f"run.dir={cfg.run.dir}", f"weights.root={cfg.weights.root}"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        with pytest.raises(runlock.RunBusy, match=f"pid {owner.pid} "):
            runlock.acquire(cfg)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    runlock.acquire(cfg).release()  # the kernel dropped the dead owner's flock


def test_an_unwritable_place_names_the_field(cfg, tmp_path):
    import msgspec

    (tmp_path / "file").write_text("")
    bad = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, dir=str(tmp_path / "file" / "runs")))
    with pytest.raises(runlock.ConfigError, match="config field run.dir: cannot create the run's lock file"):
        runlock.acquire(bad)
