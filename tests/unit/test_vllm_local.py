"""`vllm/local.LocalBackend`: how it starts vLLM in the rollout daemon's process (vLLM replaced by a recorder)."""

import os
import sys
import types

import pytest

from offpolicy.config import load_config
from offpolicy.rollout.engines.vllm.local import LocalBackend

CONFIG = "configs/quickstart-vllm.yaml"


@pytest.fixture
def started(monkeypatch):
    """LocalBackend._start(on_cpu) with a stand-in `vllm.LLM` that records the environment it was built in."""
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
            seen["model"] = kwargs["model"]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    cfg = load_config(CONFIG, ["rollout.vllm.verify=false"])

    def start(on_cpu: bool) -> dict:
        LocalBackend(cfg, 0, on_cpu)._start("/versions/v3")
        return seen

    return start


def test_on_a_gpu_the_engine_core_is_spawned(started):
    """The daemon has CUDA up before vLLM starts (its stagings read onto the GPU): a forked engine core fails with
    "Cannot re-initialize CUDA in forked subprocess" (seen on an H200), so vLLM is told to spawn it."""
    seen = started(on_cpu=False)
    assert seen == {"method": "spawn", "model": "/versions/v3"}


def test_a_users_choice_and_the_cpu_are_left_alone(started, monkeypatch):
    assert started(on_cpu=True)["method"] is None  # no CUDA on the CPU: vLLM's own default
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert started(on_cpu=False)["method"] == "fork"
