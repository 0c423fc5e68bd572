"""SGLang (0.5.14 on our GPU machines) proving GPT-OSS bf16 loads by fingerprint, for real: SGLang's GPT-OSS has no
get_weights_by_name, so `rollout.sglang.proof: auto` proves each load by the fingerprint of every tensor, computed in
SGLang's TP worker by offpolicy's custom weight loader (offpolicy/rollout/engines/sglang/worker.py) through
`update_weights_from_tensor`, against the version's files (fingerprint_proof.py). The tiny GPT-OSS
(configs/gptoss-tiny.yaml, head_dim 64) in bf16 on SGLang's own layout (fused qkv, its MoE's transposed, interleaved
experts, float32 expert biases): in process (sglang.Engine) and over HTTP (a `sglang.launch_server` launched with
--custom-weight-loader), each version's load proven; the proof tells a version it did not load from the one it holds;
and the samples after each proof are still the loaded version's (the loader wrote no weight). Needs sglang and a CUDA
GPU (skipped otherwise): `bash benchmarks/servers_gpu1.sh` runs it beside the others, or
`PYTHONPATH=.:/tmp/site:/tmp/ssite python3 -m pytest -s tests/gpu/test_sglang_gpu.py` after
`bash deploy/gpu/server.sh sglang install`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.sglang.worker import LOADER
from offpolicy.weights import WeightStore
from offpolicy.weights.config_json import complete
from tests.conftest import sglang_port
from tests.vllm_servers import ROOT, Server, perturbed, publish, sample_distances

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
              pytest.mark.timeout(1200)]

GPTOSS = ROOT / "configs" / "gptoss-tiny.yaml"
PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 5, 5, 9, 12]]
PARAMS = SamplingParams(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)
GROUPS = {"model.embed_tokens", "lm_head", "model.norm", *(f"model.layers.{i}.{m}" for i in (0, 1) for m in (
    "input_layernorm", "post_attention_layernorm", "self_attn", "mlp"))}  # the tiny GPT-OSS's module groups
MODEL = ["model.arch.head_dim=64", "model.dtype=bfloat16"]
BF16 = [*MODEL, "rollout.engine=sglang", "rollout.sglang.mem_fraction_static=0.3", "rollout.sglang.attention_backend=triton"]


def initial(tmp_path):
    """The tiny GPT-OSS in bf16 saved as the launch checkpoint (its config.json completed as a version's is), and the
    model."""
    from offpolicy.models.build import build_model

    # the model section alone: BF16's rollout.engine=sglang (in process by default) would want a model.path
    model = build_model(load_config(GPTOSS, MODEL).model, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "initial")
    path = tmp_path / "initial" / "config.json"
    path.write_text(json.dumps(complete(json.loads(path.read_text()))))  # SGLang's transformers wants swiglu_limit
    return tmp_path / "initial", model


def proven_versions(engine, model, store, versions) -> list[dict]:
    """Load each version through `engine`: its record is proven by fingerprint, and its samples are the version's."""
    rows, before = [], None
    for version in versions:
        perturbed(model, version, 0.05)
        reference = copy.deepcopy(model).float().eval()
        with publish(store, version, model) as wv:
            engine.load(wv)
        (record,) = engine.last_loads
        print(f"SGLang GPT-OSS bf16 version {version}: {record}")
        assert record["verified"] and record["proof"] == "fingerprint", record
        assert set(record["changed"]) == GROUPS <= set(record["groups"]), record  # every group of the files checked
        mean, worst, old = sample_distances(engine, PROMPTS, PARAMS, reference, before)
        print(f"  |SGLang - HF| of the sampled logprobs after the proof: mean {mean:.4f} max {worst:.4f}; against the "
              f"previous version: {old}")
        assert np.isfinite(worst) and (old is None or mean < old)  # the loader wrote no weight
        rows.append(record)
        before = reference
    return rows


def test_gptoss_bf16_loads_in_process_are_proven_by_fingerprint(tmp_path, shm_root):
    launch, model = initial(tmp_path)
    cfg = load_config(GPTOSS, [*BF16, f"model.path={launch}", f"weights.root={shm_root}",
                               "rollout.sglang.extra.disable_cuda_graph=true"])
    engine = make_engine(cfg, seed=1)
    try:
        assert LOADER in engine.backend.engine.tokenizer_manager.server_args.custom_weight_loader
        assert engine.backend.fingerprint.offset is not None, engine.backend.fingerprint.why  # the start's baseline
        store = WeightStore(shm_root, "sgl-fp", keep=10)
        records = proven_versions(engine, model, store, (1, 2))
        print("SGLang fingerprint proof seconds: " + ", ".join(f"{r['proof_seconds']:.3f}" for r in records))
        perturbed(model, 3, 0.05)
        with publish(store, 3, model) as wv, pytest.raises(WeightUpdateError, match="it still holds version 2's"):
            engine.backend.fingerprint.prove(str(wv.path), 3, "SGLang")  # a version it did not load
    finally:
        engine.close()


def test_gptoss_bf16_loads_into_a_server_are_proven_by_fingerprint(tmp_path, shm_root):
    launch, model = initial(tmp_path)
    port = sglang_port()
    url = f"http://127.0.0.1:{port}"
    server = Server([sys.executable, "-m", "sglang.launch_server", "--model-path", str(launch), "--host", "127.0.0.1",
                     "--port", str(port), "--skip-tokenizer-init", "--mem-fraction-static", "0.3",
                     "--attention-backend", "triton", "--disable-cuda-graph", "--custom-weight-loader", LOADER],
                    dict(os.environ), url, tmp_path / "sglang.log")
    try:
        server.start()  # waits for /health
        cfg = load_config(GPTOSS, [*BF16, f"weights.root={shm_root}", "rollout.sglang.mode=http",
                                   f"rollout.sglang.urls=[{url}]", "rollout.sglang.startup_timeout_s=600"])
        engine = make_engine(cfg)
        proven_versions(engine, model, WeightStore(shm_root, "sgl-fp-http", keep=10), (1, 2))
        engine.close()
    finally:
        server.stop()
