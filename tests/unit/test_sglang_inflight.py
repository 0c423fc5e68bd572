"""Weight updates in flight on SGLang servers over HTTP (rollout.inflight_updates, sglang/inflight.py), against a
stand-in server in token mode (tests/sglang_fake.py: a token a row every `token_s`, each token's logprob the mark of
the version that made it, pauses with mode abort ending the running requests): every token keeps the version that
produced it, every sample comes back whole, and a failed switch ends the call without leaving a server paused."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from offpolicy.config import ConfigError, load_config
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.sglang.inflight import Announcer
from offpolicy.rollout.engines.errors import Stopped
from offpolicy.rollout.engines.sglang.wire import RetriesExhausted, VersionMismatch, WeightUpdateError
from offpolicy.wire.protocol import VersionRun
from offpolicy.wire.versions import token_versions
from tests.sglang_fake import version_logprob
from tests.sglang_http import EOS, engine, fakes, loaded, store  # noqa: F401  (fixtures)

LONG = SamplingParams(n=2, temperature=1.0, max_new_tokens=120)
PROMPTS = [[11, 1, 2, 12], [11, 5, 12]]
INFLIGHT = {"rollout.inflight_updates": "true"}  # rollout.sglang.inflight_switch: abort_all, the default
ABORT_ALL = {**INFLIGHT, "rollout.sglang.inflight_switch": "abort_all"}
PAUSE = {**INFLIGHT, "rollout.sglang.inflight_switch": "pause"}
SWITCHES = pytest.mark.parametrize("options", [PAUSE, ABORT_ALL], ids=["pause", "abort_all"])


def announce_when_held(e, fake, *versions) -> threading.Thread:
    """Hand each of `versions` to the engine's announcer (as the rollout daemon does when it hears of one) once the
    stand-in holds a generate call at its next `hold_at` token: the switches land at known tokens, however busy the
    machine."""
    def run():
        for wv in versions:
            assert fake.holding.wait(30)
            fake.holding.clear()
            e.prefetcher.prefetch(wv)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def check_labels(groups, params: SamplingParams = LONG) -> list[list[VersionRun]]:
    """Every sample whole (n a prompt, ends on EOS within max_new_tokens) and every token's logprob the mark of the
    version its runs give it: no token is labelled with a version that did not make it."""
    runs = []
    assert [len(g) for g in groups] == [params.n] * len(groups)
    for c in (c for g in groups for c in g):
        assert c.finish_reason == "stop" and c.tokens[-1] == EOS and len(c.tokens) <= params.max_new_tokens
        assert c.version_runs and c.version_runs[0].start == 0
        versions = token_versions(c.version_runs, len(c.tokens))
        assert np.array_equal(c.logprobs, np.array([version_logprob(str(v)) for v in versions], dtype=np.float32))
        runs.append(c.version_runs)
    return runs


def test_a_generation_switches_to_a_version_announced_meanwhile_and_labels_every_token(fakes, store):
    (fake,) = fakes()
    fake.token_s, fake.hold_at = 0.001, [30]
    e = loaded(store, fake.url, **PAUSE)
    assert isinstance(e.prefetcher, Announcer) and e.inflight is not None
    announce_when_held(e, fake, store(1))
    runs = check_labels(e.generate(PROMPTS, LONG))
    assert e.version == 1
    # switched midway: each sample's first 30 tokens from version 0, the rest from version 1
    assert runs == [[VersionRun(0, 0), VersionRun(30, 1)]] * 4, runs
    pause = [b for _, p, b in fake.calls if p == "/pause_generation"]
    assert pause[-1] == {"mode": "abort"}  # a switch aborts the running requests, whatever rollout.sglang.pause_mode
    assert [b["weight_version"] for _, p, b in fake.calls if p == "/update_weights_from_disk"] == ["0", "1"]
    assert not fake.paused
    # the continuations: each sample's prompt plus its tokens so far, with what was left of max_new_tokens
    sent = [b for _, p, b in fake.calls if p == "/generate"]
    assert len(sent) == 2 and len(sent[1]["input_ids"]) == 4
    for row, sp in zip(sent[1]["input_ids"], sent[1]["sampling_params"]):
        prompt = next(p for p in PROMPTS if row[:len(p)] == p)
        assert sp["max_new_tokens"] == LONG.max_new_tokens - (len(row) - len(prompt))
    (record,) = e.prefetcher.drain()  # the daemon's report: switched in flight, nothing read ahead
    assert (record.version, record.outcome, record.inflight) == (1, "unstaged", True)
    assert [m for m, _ in record.proofs] == ["disk"] and record.swap_seconds > 0  # (proven as loads between calls
    # are: these tiny versions hold no tensor a read-back knows, so both are recorded unproven)
    assert e.prefetcher.drain() == []


@SWITCHES
def test_two_versions_in_one_call_are_switched_to_in_turn(fakes, store, options):
    (fake,) = fakes()
    fake.token_s, fake.hold_at = 0.001, [20, 40]  # the continuation holds after 40 more tokens
    e = loaded(store, fake.url, **options)
    announce_when_held(e, fake, store(1), store(2))
    runs = check_labels(e.generate(PROMPTS, LONG))
    assert e.version == 2
    assert runs == [[VersionRun(0, 0), VersionRun(20, 1), VersionRun(60, 2)]] * 4, runs
    assert [(r.version, r.outcome) for r in e.prefetcher.drain()] == [(1, "unstaged"), (2, "unstaged")]


def test_an_abort_all_switch_is_one_update_that_aborts_the_running_requests_and_labels_every_token(fakes, store):
    """rollout.sglang.inflight_switch=abort_all: no pause and no continue, the update itself aborts the running
    requests (abort_all_requests) and holds the continuations until it is done, so they run on the new version."""
    (fake,) = fakes()
    fake.token_s, fake.hold_at = 0.001, [30]
    e = loaded(store, fake.url, **ABORT_ALL)
    before = len(fake.calls)
    announce_when_held(e, fake, store(1))
    runs = check_labels(e.generate(PROMPTS, LONG))
    assert e.version == 1 and runs == [[VersionRun(0, 0), VersionRun(30, 1)]] * 4, runs
    during = fake.calls[before:]
    assert not [p for _, p, _ in during if p in ("/pause_generation", "/continue_generation")]
    (update,) = [b for _, p, b in during if p == "/update_weights_from_disk"]
    assert update["abort_all_requests"] is True and update["weight_version"] == "1" and update["flush_cache"] is True
    first = [b for _, p, b in fake.calls[:before] if p == "/update_weights_from_disk"]
    assert "abort_all_requests" not in first[0]  # a load between calls pauses by rollout.sglang.pause_mode as before
    assert [(r.version, r.outcome) for r in e.prefetcher.drain()] == [(1, "unstaged")]


def test_without_an_announcement_nothing_switches(fakes, store):
    (fake,) = fakes()
    fake.token_s = 0.001
    e = loaded(store, fake.url, **INFLIGHT)
    runs = check_labels(e.generate(PROMPTS, LONG))
    assert runs == [[VersionRun(0, 0)]] * 4
    assert "/pause_generation" not in fake.paths()[-2:] and len([p for p in fake.paths() if p == "/generate"]) == 1


def test_a_version_loaded_between_calls_is_not_switched_to_again(fakes, store):
    (fake,) = fakes()
    fake.token_s = 0.001
    e = loaded(store, fake.url, **INFLIGHT)
    e.prefetcher.prefetch(store(1))
    e.load(store(1))  # the daemon's swap between leases took it
    assert [r.version for r in e.prefetcher.drain()] == []  # a load between calls, nothing read ahead: not reported
    check_labels(e.generate(PROMPTS, LONG))
    assert [b["weight_version"] for _, p, b in fake.calls if p == "/update_weights_from_disk"] == ["0", "1"]


@pytest.mark.parametrize(("options", "last"), [(PAUSE, "/continue_generation"),
                                               (ABORT_ALL, "/update_weights_from_disk")], ids=["pause", "abort_all"])
def test_a_refused_switch_ends_the_call_with_its_error_and_leaves_no_server_paused(fakes, store, options, last):
    (fake,) = fakes()
    fake.token_s, fake.hold_at = 0.001, [10]
    e = loaded(store, fake.url, **options)
    fake.refuse_update = "load"
    announce_when_held(e, fake, store(1))
    with pytest.raises(WeightUpdateError, match="refused weight version 1"):
        e.generate(PROMPTS, LONG)
    assert e.version == 0 and not fake.paused and not fake.updating and fake.paths()[-1] == last
    assert len([p for p in fake.paths() if p == "/generate"]) == 1  # nothing sent on to weights of neither version


def test_an_answer_of_a_version_the_engine_never_loaded_raises(fakes, store):
    (fake,) = fakes()
    fake.token_s = 0.001
    e = loaded(store, fake.url, **INFLIGHT)
    fake.report_version = "7"
    with pytest.raises(VersionMismatch, match="weight version '7', not one of \\[0\\]"):
        e.generate(PROMPTS, LONG)


def test_aborts_without_a_switch_go_on_from_their_tokens_and_count_to_max_retries(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **INFLIGHT)
    fake.abort_rows = 2  # SGLang aborts two rows after their first token (not a switch of ours)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    groups = e.generate(PROMPTS, params)
    assert e.aborted == 2
    sent = [b for _, p, b in fake.calls if p == "/generate"]
    assert [len(r) for r in sent[1]["input_ids"]] == [len(PROMPTS[0]) + 1, len(PROMPTS[1]) + 1]  # their first tokens
    assert [sp["max_new_tokens"] for sp in sent[1]["sampling_params"]] == [5, 5]
    for c in (c for g in groups for c in g):
        assert c.finish_reason == "stop" and c.tokens[-1] == EOS and len(c.tokens) <= 6
        assert c.version_runs == [VersionRun(0, 0)]
    fake.abort_rows = 100
    with pytest.raises(RetriesExhausted, match="raise rollout.sglang.max_retries"):
        e.generate(PROMPTS, params)


def test_a_request_aborted_before_its_prefill_comes_back_without_a_label_and_goes_on(fakes, store):
    (fake,) = fakes()
    e = loaded(store, fake.url, **INFLIGHT)
    fake.abort_unstarted = 3  # SGLang's answer for a request aborted in its waiting queue: no tokens, no version
    groups = e.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
    assert e.aborted == 3 and [len(g) for g in groups] == [2, 2]
    for c in (c for g in groups for c in g):
        assert c.finish_reason == "stop" and c.tokens[-1] == EOS and c.version_runs == [VersionRun(0, 0)]
        assert c.meta["prompt_tokens"] in (len(PROMPTS[0]), len(PROMPTS[1]))  # the answer's that had tokens


def test_interrupt_ends_an_in_flight_call_at_once(fakes, store):
    (fake,) = fakes()
    fake.token_s, fake.hold_at = 0.001, [5]  # the call holds (30 s) after 5 tokens: only the cut can end it
    e = loaded(store, fake.url, **INFLIGHT)
    outcome: dict = {}

    def generate() -> None:
        try:
            e.generate(PROMPTS, LONG)
        except Stopped as err:  # the daemon's clean stop, not a server down
            outcome["error"] = str(err)

    t = threading.Thread(target=generate)
    t.start()
    assert fake.holding.wait(10)
    e.interrupt()
    t.join(10)
    assert not t.is_alive() and "cut: the daemon stops" in outcome.get("error", ""), outcome


def test_inflight_updates_true_is_accepted_for_sglang_servers_and_refused_in_process():
    base = ["model.arch.model_type=llama", "rollout.engine=sglang", "rollout.inflight_updates=true",
            "rollout.sglang.urls=[http://127.0.0.1:1]"]
    cfg = load_config(None, [*base, "rollout.sglang.mode=http", "rollout.double_buffer=false"])
    assert cfg.rollout.inflight_updates is True  # nothing is read ahead for SGLang's servers: no double buffer needed
    with pytest.raises(ConfigError, match="rollout.sglang.mode=http"):
        load_config(None, [*base, "rollout.sglang.mode=engine"])
