"""SGLangEngine over HTTP against stand-in servers (tests/sglang_fake.py): the fixtures and helpers its tests share."""

from __future__ import annotations

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.rollout.engines import make_engine
from offpolicy.rollout.engines.sglang import SGLangEngine
from offpolicy.weights import WeightStore, WeightVersion, version_dir
from tests.sglang_fake import FakeSGLang

EOS = 13  # the digit tokenizer's


@pytest.fixture
def fakes():
    made: list[FakeSGLang] = []

    def make(n: int = 1, **kw) -> list[FakeSGLang]:
        new = [FakeSGLang(**kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for f in made:
        if f.thread.is_alive():
            f.stop()


@pytest.fixture
def store(shm_root):
    """Publishes tiny weight versions; returns WeightVersion views of them."""
    s = WeightStore(shm_root, "sgl", keep=10)

    def publish(version: int) -> WeightVersion:
        if not version_dir(shm_root, "sgl", version).exists():
            s.publish(version, [("w", torch.full((2,), float(version)))], {"model_type": "llama"})
        return WeightVersion(version_dir(shm_root, "sgl", version))

    return publish


def engine(*urls: str, **options) -> SGLangEngine:
    overrides = ["model.arch.model_type=llama", f"model.arch.eos_token_id={EOS}",  # (llama's default eos is 2)
                 "rollout.engine=sglang", "rollout.sglang.mode=http",
                 f"rollout.sglang.urls=[{', '.join(urls)}]", "rollout.sglang.startup_timeout_s=5",
                 *(f"{k}={v}" for k, v in options.items())]
    e = make_engine(load_config(None, overrides))
    assert isinstance(e, SGLangEngine)
    return e


def loaded(store, *urls: str, **options) -> SGLangEngine:
    """An engine on `urls` that has loaded weight version 0."""
    e = engine(*urls, **options)
    e.load(store(0))
    return e


