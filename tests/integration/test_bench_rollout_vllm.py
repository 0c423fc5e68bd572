"""`offpolicy bench rollout --engines` with real vLLM: a server it launches (http) and vllm.LLM in process,
beside the torch engine and transformers generate, at a tiny size; checks the result's structure."""

from __future__ import annotations

import pytest

from tests.unit.test_bench import TINY, bench, check_engines, positive
from tests.vllm_servers import require_vllm, vllm_env

require_vllm()


@pytest.mark.slow  # a vLLM server and an in-process vLLM engine start (~2-4 min on 2 busy cores)
def test_rollout_bench_measures_vllm_server_and_in_process_engine(tmp_path, monkeypatch):
    for k, v in vllm_env(tmp_path / "cache").items():
        monkeypatch.setenv(k, v)
    doc = bench(tmp_path, "rollout", "--engines", "torch", "hf", "vllm", "vllm-engine", *TINY)
    check_engines(doc, ["torch", "hf", "vllm", "vllm-engine"])
    http, local = doc["results"]["vllm"], doc["results"]["vllm-engine"]
    assert http["swap_methods"] == [{"method": "inplace", "verified": True}] * 3  # versions 0, 1, 2, each proven
    assert "vllm.entrypoints.openai.api_server" in http["command"] and positive(http["server_ready_seconds"])
    plain = http["unverified"]
    assert plain["first"]["method"] == "rebuild" and positive(plain["first"]["seconds"], plain["swap_seconds"])
    assert plain["swap_methods"] == [{"method": "inplace", "verified": False}] * 2
    assert local["swap_methods"] == [{"method": "start", "verified": False}] + \
        [{"method": "inplace", "verified": True}] * 2
    assert (tmp_path / "vllm-server.log").stat().st_size > 0
    assert doc["vllm"] and "| vLLM server, swaps with rollout.vllm.verify=false |" in (tmp_path / "rollout.md").read_text()
