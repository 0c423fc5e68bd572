"""Weight updates in flight on a real SGLang server (rollout.inflight_updates over HTTP, sglang/inflight.py), checked
token by token: version v of `one_token_model` samples TOKEN[v] at every step, so a sample switched after k tokens is
k x TOKEN[v0] then (L - k) x TOKEN[v1], and its `version_runs` must say exactly that. Both switches of
rollout.sglang.inflight_switch run on one server, each on versions of its own: SGLang 0.5.14's pause with mode
abort, and update_weights_from_disk with abort_all_requests, end the running requests with the tokens they sampled;
the engine sends them on as continuations on the new version. Needs sglang and a CUDA GPU (skipped otherwise):
`PYTHONPATH=.:/tmp/site:/tmp/ssite python3 -m pytest -s tests/gpu/test_sglang_inflight_gpu.py` after
`bash deploy/gpu/server.sh sglang install`."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.wire.versions import token_versions
from offpolicy.weights import WeightStore
from tests.conftest import sglang_port
from tests.vllm_servers import ROOT, Server, one_token_model, publish

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
              pytest.mark.timeout(900)]

PROMPT = [11, 1, 2, 3, 4, 12]
LONG = SamplingParams(n=6, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1000)
MODEL = ["model.arch.hidden_size=128", "model.arch.max_position_embeddings=1100", "model.dtype=bfloat16"]
ANNOUNCE_S = 1.0  # into the call: ~1,000 steps of the tiny model take several seconds on an H200 without CUDA graphs


def test_a_generation_on_a_real_server_switches_versions_in_flight(tmp_path, shm_root):
    from offpolicy.models.build import build_model

    cfg0 = load_config(ROOT / "configs" / "quickstart-vllm.yaml", MODEL)
    build_model(cfg0.model, torch.device("cpu")).save_pretrained(tmp_path / "initial")
    port = sglang_port()
    url = f"http://127.0.0.1:{port}"
    server = Server([sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path / "initial"),
                     "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--mem-fraction-static",
                     "0.3", "--attention-backend", "triton", "--disable-cuda-graph"],
                    dict(os.environ), url, tmp_path / "sglang.log")
    token = {0: 5, 1: 6}
    try:
        server.start()
        for switch in ("pause", "abort_all"):  # rollout.sglang.inflight_switch, one after the other on one server
            switch_in_flight(url, switch, token, shm_root)
    finally:
        server.stop()


def switch_in_flight(url: str, switch: str, token: dict[int, int], shm_root: str) -> None:
    cfg = load_config(ROOT / "configs" / "quickstart-vllm.yaml", [
        *MODEL, "rollout.engine=sglang", "rollout.sglang.mode=http", f"rollout.sglang.urls=[{url}]",
        "rollout.sglang.startup_timeout_s=600", "rollout.inflight_updates=true",
        f"rollout.sglang.inflight_switch={switch}", f"weights.root={shm_root}"])
    engine = make_engine(cfg)
    store = WeightStore(shm_root, f"sgl-inflight-{switch}", keep=10)
    try:
        with publish(store, 0, one_token_model(cfg.model, token[0])) as v0:
            engine.load(v0)
        v1 = publish(store, 1, one_token_model(cfg.model, token[1]))
        t0 = time.perf_counter()
        announce = threading.Timer(ANNOUNCE_S, engine.prefetcher.prefetch, [v1])
        announce.start()
        groups = engine.generate([PROMPT], LONG)
        seconds = time.perf_counter() - t0
        announce.join()
        assert engine.version == 1, "no switch: the call ended before the announcement"
        split = []
        for c in groups[0]:
            assert len(c.tokens) == LONG.max_new_tokens and c.finish_reason == "length"
            versions = token_versions(c.version_runs, len(c.tokens))
            np.testing.assert_array_equal(c.tokens, np.vectorize(token.get)(versions))  # each token's own version
            split.append(int((versions == 0).sum()))
        assert all(0 < k < LONG.max_new_tokens for k in split), split  # the switch found every sample under way
        (record,) = engine.prefetcher.drain()
        assert (record.version, record.outcome, record.inflight) == (1, "unstaged", True), record
        print(f"SGLang in flight, inflight_switch={switch}: tokens of the old version per sample {split}; the switch "
              f"(update and proof) {record.swap_seconds:.3f} s; the call {seconds:.2f} s")
        t0 = time.perf_counter()
        for c in engine.generate([PROMPT], LONG)[0]:  # the next call begins on the new version
            assert set(c.tokens.tolist()) == {token[1]} and [r.version for r in c.version_runs] == [1]
        print(f"SGLang: the same call without a switch {time.perf_counter() - t0:.2f} s")
        v1.close()
    finally:
        engine.close()
