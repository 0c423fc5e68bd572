"""The in-process SGLang engine when a scheduler process dies (offpolicy/rollout/engines/sglang/sigquit.py), against
a stand-in `sglang` whose Engine runs a real scheduler process and signals like sglang 0.5.14
(tests/sglang_inprocess.py): the engine's SIGQUIT is ours, a generate in flight and every later call raise EngineLost
naming the process and how it ended, the daemon is told, and an engine shut down on purpose (an mxfp4 restart, close)
takes no SIGQUIT for a failure. The rollout daemon's side: tests/integration/test_sglang_daemons.py."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import tests.sglang_inprocess as standin
from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.errors import EngineLost
from offpolicy.rollout.engines.sglang import local, sigquit
from offpolicy.rollout.engines.sglang.local import LocalBackend
from tests.integration.helpers import wait_for

LOST = r"SGLang's scheduler process exited \(sglang::scheduler_TP0 \(pid {pid}\) {how}\): the in-process engine is " \
       r"gone; the rollout daemon exits so that its supervisor restarts it; see the daemon's log above"
PARAMS = SamplingParams(n=2, max_new_tokens=4, stop_token_ids=(13,))


@pytest.fixture
def plan(monkeypatch, tmp_path):
    """Install the stand-in (its SIGQUIT handler records instead of killing pytest); plan(**knobs) sets its plan."""

    def set_plan(**knobs) -> Path:
        monkeypatch.setenv(standin.ENV, json.dumps({"dir": str(tmp_path), **knobs}))
        return tmp_path

    with standin.installed(monkeypatch):
        set_plan()
        yield set_plan


def native():
    return load_config(None, ["model.path=/m", "rollout.engine=sglang"])


def in_thread(call) -> dict:
    """Run `call` as the daemon runs generate and load (asyncio.to_thread); the dict gets its "result" or "error"."""
    out: dict = {}

    def run():
        try:
            out["result"] = call()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


@pytest.mark.parametrize("how", ["killed", "raised"])
def test_a_scheduler_that_dies_mid_generate_fails_the_generate_and_tells_the_daemon(plan, how):
    """killed: SIGKILLed while it generates (OOM, a C++ abort): SGLang's SubprocessWatchdog signals; raised: its request
    raised, it signals itself and exits 0. Either way the generate waiting on it raises EngineLost, as does every call
    after it, and the daemon hears it once."""
    where = plan(hang_at=1) if how == "killed" else plan(fail_at=1)
    engine = make_engine(native(), seed=0)
    heard: list[str] = []
    engine.on_lost(heard.append)
    assert signal.getsignal(signal.SIGQUIT) is sigquit._on_sigquit  # not SGLang's, which kills the process tree
    pid = engine.backend.engine.scheduler.pid
    call = in_thread(lambda: engine.generate([[1, 2, 3]], PARAMS))
    if how == "killed":
        wait_for(lambda: (where / "generates").read_text() == "1", 30, "the scheduler to take the generate")
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not call["thread"].is_alive(), 30, "the generate to end")
    status = "was killed by SIGKILL" if how == "killed" else "exited with code 0"
    assert isinstance(call.get("error"), EngineLost), call
    assert re.match(LOST.format(pid=pid, how=status), str(call["error"])), str(call["error"])
    wait_for(lambda: heard, 10, "the daemon's callback")
    assert heard == [str(call["error"])]
    with pytest.raises(EngineLost, match="the in-process engine is gone"):
        engine.generate([[1]], PARAMS)
    with pytest.raises(EngineLost, match="the in-process engine is gone"):
        engine.backend.update_weights("/no/version", 0)  # refused before anything is read
    assert standin.SIGQUITS_TAKEN == []  # SGLang's handler never ran
    engine.close()
    assert signal.getsignal(signal.SIGQUIT) is not sigquit._on_sigquit  # the one before the engine took it back


def test_a_scheduler_that_fails_at_the_first_start_raises_in_the_daemon_and_kills_nothing(plan):
    """The first (native) start runs off the main thread, so SGLang's launch-phase handler, which kills the process
    tree, is never put in place: the scheduler's SIGQUIT reaches ours and the start raises here, where the daemon
    logs it and exits 1."""
    plan(fail_start=True)
    heard: list[str] = []
    watch_listeners = sigquit.SchedulerWatch.__init__

    def listening(self, *a, **k):
        watch_listeners(self, *a, **k)
        self.listeners.append(heard.append)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(sigquit.SchedulerWatch, "__init__", listening)
        with pytest.raises((RuntimeError, EngineLost), match="scheduler"):
            LocalBackend(native(), seed=0)
    assert standin.SIGQUITS_TAKEN == []  # SGLang's handler was never in place: it would have killed this process
    wait_for(lambda: heard, 10, "the watch to hear the scheduler's SIGQUIT")
    assert "SGLang's scheduler process exited" in heard[0], heard[0]


def test_the_scheduler_outlives_the_start_and_a_close_ends_the_thread_that_started_it(plan):
    """The stand-in's scheduler dies with the thread that started it (PR_SET_PDEATHSIG, as SGLang's): a start in a
    thread that ended with it had it SIGKILLed once the engine was ready (owner.py); close shuts it down, then lets
    that thread go."""
    b = LocalBackend(native(), seed=0)
    owner, scheduler = b.owner, b.engine.scheduler
    assert owner is not None and owner.thread is not threading.main_thread() and owner.holding
    time.sleep(1.0)  # the stand-in's watchdog looks every 0.2 s
    assert scheduler.exitcode is None and not b.watch.signalled
    assert b.generate([[1, 2]], [{"max_new_tokens": 3, "stop_token_ids": [13]}], 1, -1)[0]["output_ids"]
    b.close()
    assert scheduler.exitcode == -signal.SIGKILL and not owner.holding and b.owner is None


def test_a_start_that_fails_after_the_engine_is_up_shuts_the_engine_down(plan, monkeypatch):
    """The fingerprint baseline (or anything after sglang.Engine returned) raising in the constructor: no backend is
    returned, so nobody would close it; its engine is shut down and its thread let go before the error goes on."""
    seen: dict = {}

    def failing(self, kwargs):
        seen.update(scheduler=self.engine.scheduler, owner=self.owner)
        raise OSError("the checkpoint went away")

    monkeypatch.setattr(LocalBackend, "_started", failing)
    with pytest.raises(OSError, match="went away"):
        LocalBackend(native(), seed=0)
    wait_for(lambda: seen["scheduler"].exitcode is not None, 10, "the scheduler to end")
    assert not seen["owner"].holding


def test_a_scheduler_killed_while_the_engine_is_idle_ends_the_engine_at_once(plan):
    b = LocalBackend(native(), seed=0)
    heard: list[str] = []
    b.watch.listeners.append(heard.append)
    assert b.generate([[1, 2]], [{"max_new_tokens": 3, "stop_token_ids": [13]}], 1, -1)[0]["output_ids"]
    pid = b.engine.scheduler.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: heard, 10, "the watch to hear SGLang's SIGQUIT")
    assert re.match(LOST.format(pid=pid, how="was killed by SIGKILL"), heard[0]), heard[0]
    with pytest.raises(EngineLost):
        b.generate([[1, 2]], [{"max_new_tokens": 3}], 1, -1)
    b.close()


def test_an_mxfp4_restart_and_close_take_no_sigquit_for_a_failure(plan, monkeypatch):
    """Every mxfp4 version after the first starts the engine again (local.py): Engine.shutdown SIGKILLs its processes,
    and the stand-in's sends its own process a SIGQUIT first, which the watch counts and ignores. (The versions' files
    and their proof are test_sglang_formats.py's: here each load is taken as it is.)"""
    plan(sigquit_on_shutdown=True)
    monkeypatch.setattr(local, "expect", lambda path, version: None)
    monkeypatch.setattr(local, "prove", lambda *args, **kw: {"verified": False, "why": "not read here"})
    cfg = load_config(None, ["rollout.engine=sglang", "weights.formats=[mxfp4]", "rollout.weights_format=mxfp4",
                             "model.arch.model_type=llama"])
    b = LocalBackend(cfg, seed=0)
    b.update_weights("/store/v0", 0)  # starts the engine (here in the main thread: SGLang's handler, then ours again)
    first, first_owner = b.engine.scheduler, b.owner
    b.update_weights("/store/v1", 1)  # shuts it down (a SIGQUIT) and starts another
    assert first_owner is not None and not first_owner.holding and b.owner is not None and b.owner.holding
    assert [s["method"] for s in b.swaps] == ["start", "restart"] and first.exitcode == -signal.SIGKILL
    assert b.watch.ignored == 1 and not b.watch.signalled
    assert signal.getsignal(signal.SIGQUIT) is sigquit._on_sigquit
    assert b.generate([[1, 2]], [{"max_new_tokens": 3, "stop_token_ids": [13]}], 1, 1)[0]["meta_info"][
        "weight_version"] == "1"
    assert b.watch.children == [b.engine.scheduler]
    b.close()
    assert b.watch.ignored == 2 and not b.watch.signalled and standin.SIGQUITS_TAKEN == []
