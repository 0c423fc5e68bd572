"""The real SGLang, end to end: `sglang.Engine` in process and `python -m sglang.launch_server` over HTTP.

Runs only where sglang is installed and a CUDA GPU is present (marker `sglang`; skipped otherwise,
which includes every CPU machine of ours). A tiny random Llama is written to disk; the engine loads
weight versions of it from the weight store, and every behaviour logprob SGLang returns is checked
against the same model in `transformers` (log-softmax of logits / temperature, teacher-forced).
The tiny GPT-OSS (configs/gptoss-tiny.yaml, head_dim 64) in native and MXFP4 versions (fp8 GPT-OSS versions are
refused for SGLang: weights/fp8_blocks.py `unserved`; tests/gpu/test_sglang_lowbit_gpu.py shows why): each version
loaded through the engine (MXFP4: each one a new sglang.Engine, the old one's processes gone), its
weight_version read back and stamped on every sample, each load but a start's proven by fingerprint (SGLang's
GPT-OSS has no read-back), and the sampled logprobs nearer transformers' on the version's (dequantized) weights than
on the previous version's.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy.config import load_config
from offpolicy.models.build import hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.sglang.wire import WeightUpdateError
from offpolicy.rollout.engines.sglang.worker import LOADER
from offpolicy.weights import WeightStore, WeightVersion, version_dir
from offpolicy.weights.config_json import complete
from tests.conftest import sglang_port
from tests.vllm_servers import ROOT, lowbit_version, perturbed, sample_distances
from tests.vllm_servers import publish as publish_version


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


def proven(engine) -> bool:
    """The last load proven by SGLang's read-back of all 9 tensors the tiny Llama has for it (its norms, embedding,
    lm_head and o_proj; docs/sglang.md, "The proof of a load"); printed for the log."""
    (record,) = engine.last_loads
    print(f"SGLang load of version {engine.version}: {record}")
    return record["verified"] and len(record["tensors"]) == 9


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
        assert proven(engine)
        check_logprobs(model, PROMPTS, engine.generate(PROMPTS, PARAMS), PARAMS.temperature)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.load(publish(shm_root, model, 1))
        assert engine.version == 1 and proven(engine)
        check_logprobs(model, PROMPTS, engine.generate(PROMPTS, PARAMS), PARAMS.temperature)
        broken = publish(shm_root, model, 2)
        for shard in Path(broken.path).glob("*.safetensors"):
            shard.unlink()
        with pytest.raises(WeightUpdateError):  # VersionRefused: the proof cannot read its files, SGLang is not asked
            engine.load(broken)
        assert engine.version == 1
    finally:
        engine.close()


def test_http_engine_drives_a_real_sglang_server(tiny, shm_root, tmp_path):
    path, model = tiny
    port = sglang_port()
    log = open(tmp_path / "sglang.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", str(path),
                               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
                               "--mem-fraction-static", "0.3", "--attention-backend", "triton",
                               "--enable-metrics", "--custom-weight-loader", LOADER],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", "rollout.engine=sglang",
                                 f"weights.root={shm_root}", "rollout.sglang.mode=http",
                                 f"rollout.sglang.urls=[http://127.0.0.1:{port}]",
                                 "rollout.sglang.startup_timeout_s=600"])
        engine = make_engine(cfg)
        for version in (0, 1):
            engine.load(publish(shm_root, model, version))
            assert engine.version == version and proven(engine)
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


GPTOSS = ROOT / "configs" / "gptoss-tiny.yaml"
GPT_PROMPTS = [[11, 1, 2, 3, 4, 12], [11, 7, 12], [11, 5, 5, 9, 12]]
GPT_PARAMS = SamplingParams(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)


@contextlib.contextmanager
def warnings_of(name: str) -> Iterator[list[str]]:
    """The warnings logger `name` gives inside the block, kept in the list it yields (sglang.Engine reconfigures
    the root logger's handlers, so caplog could miss them)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(name).addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger(name).removeHandler(handler)


def gptoss_versions(fmt: str, versions: tuple[int, ...], tmp_path, shm_root, *more: str) -> list[dict]:
    """Load `versions` of the tiny GPT-OSS in `fmt` into an in-process sglang.Engine (native: started on the
    saved initial model, then updated; mxfp4: started on the first version) and check each (module
    docstring); a row per version: seconds of the load, whether it started a new engine, the logprob distances."""
    import psutil

    from offpolicy.models.build import build_model

    arch = ["model.arch.head_dim=64", "model.dtype=bfloat16",  # MXFP4: triton_kernels' tiles (test_vllm_gpu.py)
            *(("model.arch.hidden_size=256", "model.arch.intermediate_size=256") if fmt == "mxfp4" else ())]
    overrides = [*arch, "rollout.engine=sglang", f"weights.root={shm_root}",
                 "rollout.sglang.extra.disable_cuda_graph=true", *COMMON, *more]
    if fmt == "native":  # the engine starts on model.path: the initial model, saved
        initial = tmp_path / "initial"
        build_model(load_config(GPTOSS, arch).model, torch.device("cpu")).save_pretrained(initial)
        # as a version's config.json (weights/config_json.py): transformers 5.17 leaves swiglu_limit out, and SGLang's
        # 5.8.1 has no default for it
        (initial / "config.json").write_text(json.dumps(complete(json.loads((initial / "config.json").read_text()))))
        overrides.append(f"model.path={tmp_path / 'initial'}")
    else:
        overrides += [f"weights.formats=[{fmt}]", f"rollout.weights_format={fmt}"]
    cfg = load_config(GPTOSS, overrides)
    model, before = build_model(cfg.model, torch.device("cpu")), None
    store = WeightStore(shm_root, f"sgl-{fmt}", keep=10, fmt=fmt)
    engine, rows = make_engine(cfg, seed=1), []
    try:
        for version in versions:
            perturbed(model, version, 0.05)
            if fmt == "native":
                wv, reference = publish_version(store, version, model), copy.deepcopy(model).float().eval()
            else:
                wv, reference = lowbit_version(store, version, model, fmt)
            running, children = engine.backend.engine, psutil.Process().children(recursive=True)
            with wv:
                seconds = engine.load(wv)
            sgl = engine.backend.engine
            restarted = running is not None and sgl is not running
            assert engine.version == version and str(sgl.tokenizer_manager.server_args.weight_version) == str(version)
            if restarted:  # Engine.shutdown took the old scheduler and detokenizer with it
                left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
                assert children and not left, left
            mean, worst, old = sample_distances(engine, GPT_PROMPTS, GPT_PARAMS, reference, before)
            gemm = getattr(sgl.tokenizer_manager.server_args, "fp8_gemm_runner_backend", "?")
            print(f"SGLang GPT-OSS {fmt} version {version}: {'start' if running is None else 'restart' if restarted else 'update'} "
                  f"{seconds:.2f} s (fp8 GEMM backend {gemm}); |SGLang - HF| of the sampled logprobs: mean {mean:.4f} "
                  f"max {worst:.4f}; against the previous version's model: {old if old is None else round(old, 4)}")
            # SGLang 0.5.14's GPT-OSS has no get_weights_by_name: its loads are proven by fingerprint, but for a start's
            # own load, which measures the fingerprint's offset (docs/sglang.md, "The proof of a load")
            (record,) = engine.last_loads
            if running is None and fmt != "native":
                assert not record["verified"] and "defines the fingerprint's offset" in record["why"], record
            else:
                assert record["verified"] and record["proof"] == "fingerprint", record
            rows.append({"version": version, "seconds": seconds, "restarted": restarted, "mean": mean, "old": old})
            assert np.isfinite(worst) and (old is None or mean < old)
            before = reference
    finally:
        engine.close()
    return rows


def test_gptoss_mxfp4_versions_each_start_a_new_engine(tmp_path, shm_root):
    """Three MXFP4 versions with `rollout.sglang.mxfp4_load: restart` (what auto does where offpolicy's loader cannot
    run): the first starts sglang.Engine, each later one shuts it down and starts another (SGLang cannot reload MXFP4
    experts in place, local.py), warned once; the restart's cost printed."""
    with warnings_of("offpolicy.sglang") as warned:
        rows = gptoss_versions("mxfp4", (1, 2, 3), tmp_path, shm_root, "rollout.sglang.mxfp4_load=restart")
    assert [r["restarted"] for r in rows] == [False, True, True]
    assert len([m for m in warned if "cannot reload MXFP4" in m]) == 1, warned
    restarts = ", ".join(f"{r['seconds']:.1f}" for r in rows[1:])
    print(f"SGLang MXFP4 restart per version: {restarts} s (first start {rows[0]['seconds']:.1f} s)")


def test_gptoss_mxfp4_versions_load_in_place(tmp_path, shm_root):
    """`rollout.sglang.mxfp4_load: inplace`: the engine starts on the first MXFP4 version and takes the next ones as
    tensors through offpolicy's MXFP4 loader (mxfp4_inplace.py: the experts swizzled into the running triton_kernels
    wrappers), no restart; each load proven by fingerprint against the start's offset, the samples the version's."""
    with warnings_of("offpolicy.sglang") as warned:
        rows = gptoss_versions("mxfp4", (1, 2, 3), tmp_path, shm_root, "rollout.sglang.mxfp4_load=inplace",
                               "rollout.device=cuda")  # gptoss-tiny.yaml's cpu would read versions from disk
    assert [r["restarted"] for r in rows] == [False, False, False]
    assert not [m for m in warned if "cannot reload MXFP4" in m], warned
    print("SGLang MXFP4 in-place load per version: " + ", ".join(f"{r['seconds']:.2f}" for r in rows[1:]) + " s")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gptoss_mxfp4_versions_load_in_place_into_a_tp2_engine(tmp_path, shm_root):
    """`mxfp4_load: inplace` with tp_size 2: each TP worker writes its part of every later MXFP4 version (the
    experts' intermediate dimension cut as SGLang's loader cut the first, mxfp4_kernels.Shard), no restart, each load
    proven by the two ranks' fingerprints adding up to the files'."""
    with warnings_of("offpolicy.sglang") as warned:
        rows = gptoss_versions("mxfp4", (1, 2, 3), tmp_path, shm_root, "rollout.sglang.mxfp4_load=inplace",
                               "rollout.device=cuda", "rollout.sglang.tp_size=2")
    assert [r["restarted"] for r in rows] == [False, False, False]
    assert not [m for m in warned if "cannot reload MXFP4" in m], warned
    print("SGLang TP2 MXFP4 in-place load per version: " + ", ".join(f"{r['seconds']:.2f}" for r in rows[1:]) + " s")


def test_gptoss_native_versions_update_in_place(tmp_path, shm_root):
    """bf16 GPT-OSS (sinks, a sliding layer, YaRN) on SGLang's triton attention: the control for the low-bit rows."""
    rows = gptoss_versions("native", (1, 2), tmp_path, shm_root)
    assert [r["restarted"] for r in rows] == [False, False]
