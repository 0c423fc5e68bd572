"""The real SGLang, end to end: `sglang.Engine` in process and `python -m sglang.launch_server` over HTTP.

Runs only where sglang is installed and a CUDA GPU is present (marker `sglang`; skipped otherwise,
which includes every CPU machine of ours). A tiny random Llama is written to disk; the engine loads
weight versions of it from the weight store, and every behaviour logprob SGLang returns is checked
against the same model in `transformers` (log-softmax of logits / temperature, teacher-forced).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.sglang.wire import WeightUpdateError
from offpolicy.weights import WeightStore, WeightVersion, version_dir
from tests.conftest import free_ports


def _missing() -> str:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return ""


pytestmark = [pytest.mark.sglang, pytest.mark.skipif(bool(_missing()), reason=_missing() or "ready")]

PROMPTS = [[11, 1, 2, 3, 12], [11, 7, 7, 12]]
PARAMS = SamplingParams(n=4, temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=8)
COMMON = ["rollout.sglang.mem_fraction_static=0.3", "rollout.sglang.attention_backend=triton"]


@pytest.fixture
def tiny(tmp_path):
    """A 2-layer Llama (head_dim 64, vocab 512) saved as an HF directory; returns (path, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=11, eos_token_id=13, pad_token_id=10)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    return tmp_path / "model", model


def publish(root: str, model, version: int) -> WeightVersion:
    store = WeightStore(root, "sgl", keep=10)
    store.publish(version, hf_state(model), hf_config(model))
    return WeightVersion(version_dir(root, "sgl", version))


def check_logprobs(model, prompts, groups, temperature: float) -> None:
    """SGLang's behaviour logprobs equal transformers' log_softmax(logits / T) of the sampled tokens."""
    model = model.cuda()
    for prompt, group in zip(prompts, groups):
        assert len(group) == PARAMS.n
        for c in group:
            assert c.finish_reason in ("stop", "length") and 1 <= len(c.tokens) <= PARAMS.max_new_tokens
            assert c.finish_reason == "length" or int(c.tokens[-1]) == 13
            ids = torch.tensor([prompt + c.tokens.tolist()], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1).cpu()
            assert torch.allclose(torch.from_numpy(c.logprobs), want, atol=0.1), (c.logprobs, want)
    model.cpu()


def test_in_process_engine_generates_swaps_and_refuses_a_broken_version(tiny, shm_root):
    path, model = tiny
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", "rollout.engine=sglang",
                             f"weights.root={shm_root}", "rollout.sglang.extra.disable_cuda_graph=true", *COMMON])
    engine = make_engine(cfg, seed=1)
    try:
        engine.load(publish(shm_root, model, 0))
        check_logprobs(model, PROMPTS, engine.generate(PROMPTS, PARAMS), PARAMS.temperature)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.load(publish(shm_root, model, 1))
        assert engine.version == 1
        check_logprobs(model, PROMPTS, engine.generate(PROMPTS, PARAMS), PARAMS.temperature)
        broken = publish(shm_root, model, 2)
        for shard in Path(broken.path).glob("*.safetensors"):
            shard.unlink()
        with pytest.raises(WeightUpdateError):
            engine.load(broken)
        assert engine.version == 1
    finally:
        engine.close()


def test_http_engine_drives_a_real_sglang_server(tiny, shm_root, tmp_path):
    path, model = tiny
    (port,) = free_ports(1)
    log = open(tmp_path / "sglang.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", str(path),
                               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
                               "--mem-fraction-static", "0.3", "--attention-backend", "triton",
                               "--enable-metrics"], stdout=log, stderr=subprocess.STDOUT)
    try:
        cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", "rollout.engine=sglang",
                                 f"weights.root={shm_root}", "rollout.sglang.mode=http",
                                 f"rollout.sglang.urls=[http://127.0.0.1:{port}]",
                                 "rollout.sglang.startup_timeout_s=600"])
        engine = make_engine(cfg)
        for version in (0, 1):
            engine.load(publish(shm_root, model, version))
            assert engine.version == version
            check_logprobs(model, PROMPTS, engine.generate(PROMPTS, PARAMS), PARAMS.temperature)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "sglang:num_running_reqs" in metrics and "sglang:gen_throughput" in metrics
        engine.close()
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
