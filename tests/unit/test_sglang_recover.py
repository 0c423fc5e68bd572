"""An SGLang rollout over HTTP whose only server goes down (killed; `offpolicy run` starts it again): generate and
load wait up to rollout.sglang.recover_timeout_s for a server, bring it to the engine's version and go on
(`ServerPool.until_a_server`); past the timeout the error is raised, and the daemon's stop ends the wait at once."""

from __future__ import annotations

import threading
import time

import pytest

from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.errors import ServerUnavailable, Stopped
from tests.sglang_fake import FakeSGLang
from tests.sglang_http import engine, fakes, loaded, store  # noqa: F401  (fixtures)

PARAMS = SamplingParams(n=2, max_new_tokens=4)
FAST = {"rollout.sglang.health_check_interval_s": "0.05", "rollout.sglang.recover_timeout_s": "20"}


def kill_and_restart(fake: FakeSGLang, made: list) -> None:
    """Stop `fake`; a new stand-in takes its port 0.5 s later (the launcher's restart of a killed server)."""
    port = int(fake.url.rsplit(":", 1)[1])
    fake.stop()
    threading.Timer(0.5, lambda: made.append(FakeSGLang(port=port))).start()


@pytest.fixture
def down_then_back(fakes, store):
    """An engine on one server that has loaded version 0, whose server is then killed and restarted:
    (engine, [the new server once it is up])."""
    (fake,) = fakes()
    e, made = loaded(store, fake.url, **FAST), []
    kill_and_restart(fake, made)
    yield e, made
    for f in made:
        f.stop()


def test_a_generate_waits_for_its_restarted_server_and_brings_it_to_the_version(down_then_back):
    e, made = down_then_back
    groups = e.generate([[11, 1, 12]], PARAMS)
    assert [len(g) for g in groups] == [2] and e.version == 0
    (back,) = made
    updates = [b for _, p, b in back.calls if p == "/update_weights_from_disk"]
    assert [u["weight_version"] for u in updates] == ["0"]  # brought to the engine's version before generating
    assert back.paths().index("/update_weights_from_disk") < back.paths().index("/generate")


def test_a_load_waits_for_a_server_too(down_then_back, store):
    e, made = down_then_back
    e.load(store(1))
    assert e.version == 1 and made[0].weight_version == "1"


def test_a_server_back_after_a_switch_in_flight_is_brought_to_the_switched_version(fakes, store):
    (fake,) = fakes()
    fake.token_s, fake.hold_at = 0.001, [10]
    e, made = loaded(store, fake.url, **FAST, **{"rollout.inflight_updates": "true"}), []
    v1 = store(1)
    threading.Thread(target=lambda: fake.holding.wait(30) and e.prefetcher.prefetch(v1), daemon=True).start()
    e.generate([[11, 1, 12]], SamplingParams(n=2, max_new_tokens=40))
    assert e.version == 1  # switched in flight: no load between calls took it
    kill_and_restart(fake, made)
    try:
        e.generate([[11, 1, 12]], PARAMS)
        (back,) = made
        assert [(b["weight_version"], b["model_path"]) for _, p, b in back.calls if p == "/update_weights_from_disk"] \
            == [("1", str(v1.path))]
    finally:
        for f in made:
            f.stop()


def test_no_server_within_recover_timeout_raises(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **{**FAST, "rollout.sglang.recover_timeout_s": "0.3"})
    fake.stop()
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable):
        e.generate([[11, 1, 12]], PARAMS)
    assert time.monotonic() - t0 < 10


def test_the_daemons_stop_ends_the_wait_at_once(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **FAST)
    fake.stop()
    threading.Timer(0.5, e.interrupt).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        e.generate([[11, 1, 12]], PARAMS)
    assert time.monotonic() - t0 < 10  # not the 20 s recover_timeout_s
