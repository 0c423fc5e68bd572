"""offpolicy/rollout/daemon.py: the exit code a rollout daemon leaves with when its tasks end. A generate that the
stop itself cut (`Stopped`) may finish before the stop's own task is seen done: that is a clean stop (exit 0), not
the failure a CI run under load once saw (exit 1 on every SIGTERM that raced the cut)."""

import asyncio
import types

import pytest

from offpolicy.config import load_config
from offpolicy.rollout import daemon as daemon_module
from offpolicy.rollout.engines.errors import ServerUnavailable, Stopped

QUICKSTART = "configs/quickstart.yaml"


@pytest.fixture
def daemon(monkeypatch, tmp_path):
    armed: list[int] = []
    monkeypatch.setattr(daemon_module, "exit_deadline", lambda seconds, code, what: armed.append(code) or object())
    d = daemon_module.RolloutDaemon(load_config(QUICKSTART, [f"run.dir={tmp_path}"]))
    d.weights = types.SimpleNamespace(stop=lambda: None)
    d.armed = armed
    return d


def end(d: daemon_module.RolloutDaemon, error: BaseException | None, stop: bool) -> int:
    """The daemon's end with its work task done first (raising `error`), the stop requested before or not."""

    async def main() -> int:
        async def work():
            if error is not None:
                raise error

        if stop:  # the signal handler: the stop is set and the daemon is stopping (its deadline armed)
            d.stop.set()
            d._stopping()
        worker, stopper = asyncio.create_task(work()), asyncio.create_task(asyncio.sleep(60))
        await asyncio.wait([worker])
        return await d._end({worker}, [stopper, worker])

    return asyncio.run(main())


def test_a_generate_cut_by_the_stop_is_a_clean_exit(daemon):
    assert end(daemon, Stopped("the SGLang generate calls were cut: the daemon stops"), stop=True) == 0
    assert daemon.armed == [0]


def test_an_engine_failure_during_the_stop_still_fails(daemon):
    assert end(daemon, ServerUnavailable("no server answered"), stop=True) == 1


def test_a_cut_nobody_asked_for_is_a_failure(daemon):
    assert end(daemon, Stopped("cut"), stop=False) == 1
    assert daemon.armed == [1]  # the deadline armed by the failure's stop leaves with 1


def test_work_that_ends_cleanly_exits_0(daemon):
    assert end(daemon, None, stop=False) == 0
