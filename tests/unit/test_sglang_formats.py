"""The SGLang adapter with pre-quantized versions (rollout.weights_format fp8 / mxfp4): http mode against
stand-in servers launched from a checkpoint (tests/sglang_fake.py holds updates to the launch parameters
as sglang 0.5.23 does, tests/fixtures/sglang/quantized_checkpoint.json), and engine mode starting
`sglang.Engine` on the first version (a stand-in `sglang` module records what it is given)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from offpolicy.config import WeightsConfig, load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.sglang import local
from offpolicy.rollout.engines.sglang.local import LocalBackend, engine_kwargs
from offpolicy.rollout.engines.sglang.wire import SGLangError, WeightUpdateError
from offpolicy.weights import WeightVersion, version_dir
from offpolicy.weights.formats import store_run
from offpolicy.weights.publisher import Publisher
from tests.conftest import QUICKSTART
from tests.sglang_fake import FakeSGLang
from tests.unit.test_weights_formats import GPT_OSS


@pytest.fixture
def published(shm_root):
    """publish(run, formats, versions, arch=None, block=(32, 32)) -> {fmt: [version paths]}."""

    def publish(run: str, formats: list[str], versions: int = 2, arch: dict | None = None, block=(32, 32)):
        overrides = ["learner.device=cpu"] + (["model.arch=" + json.dumps(arch)] if arch else [])
        model = build_model(load_config(QUICKSTART, overrides).model, torch.device("cpu"))
        b = Publisher(WeightsConfig(root=shm_root, keep=5, formats=formats, fp8_block_size=block), run)
        for v in range(versions):
            b.publish(v, lambda: hf_state(model), hf_config(model))
        return {f: [str(version_dir(shm_root, store_run(run, f), v)) for v in range(versions)]
                for f in ("native", *formats)}

    return publish


@pytest.fixture
def fakes():
    made: list[FakeSGLang] = []
    yield lambda **kw: made.append(FakeSGLang(**kw)) or made[-1]
    for f in made:
        f.stop()


def http_engine(url: str, fmt: str, *extra: str):
    return make_engine(load_config(None, [
        "model.arch.model_type=llama", "rollout.engine=sglang", "rollout.sglang.mode=http",
        f"rollout.sglang.urls=[{url}]", "rollout.sglang.startup_timeout_s=5", "weights.formats=[fp8, mxfp4]",
        f"rollout.weights_format={fmt}", *extra]))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "native"])
def test_a_server_launched_from_the_formats_first_version_takes_the_next_ones(published, fakes, fmt):
    paths = published("sgl", [] if fmt == "native" else [fmt], arch=GPT_OSS if fmt == "mxfp4" else None)[fmt]
    fake = fakes(model_path=paths[0])
    e = http_engine(fake.url, fmt)
    with WeightVersion(paths[1]) as wv:
        e.load(wv)
    update = [b for _, p, b in fake.calls if p == "/update_weights_from_disk"][0]
    assert update == {"model_path": paths[1], "weight_version": "1", "flush_cache": True}  # load_format: the server's
    assert fake.model_path == paths[1] and fake.cast_silently == []
    assert len(e.generate([[11, 1, 12]], SamplingParams(n=2, max_new_tokens=3))[0]) == 2


@pytest.mark.parametrize("launched, wanted", [("native", "fp8"), ("fp8", "native"), ("fp8", "mxfp4")])
def test_a_server_launched_in_another_format_is_refused_at_start(published, fakes, launched, wanted):
    paths = published("sgl", ["fp8"])
    fake = fakes(model_path=paths[launched][0])
    with pytest.raises(SGLangError, match=f"a {launched} checkpoint, but rollout.weights_format is {wanted}"):
        http_engine(fake.url, wanted)
    assert "/update_weights_from_disk" not in fake.paths()


def test_the_stand_in_holds_updates_to_the_launch_parameters_like_sglang(published, fakes):
    """Why the start check matters: SGLang refuses a scale grid of another block size, and casts an fp8 weight
    into a bf16 parameter without a word (tests/fixtures/sglang/quantized_checkpoint.json)."""
    p32, p64 = published("b32", ["fp8"]), published("b64", ["fp8"], block=(64, 64))
    fake = fakes(model_path=p32["fp8"][0])
    e = http_engine(fake.url, "fp8")
    with WeightVersion(p64["fp8"][1]) as wv, pytest.raises(WeightUpdateError, match=r"Attempted to load weight"):
        e.load(wv)
    native = fakes(model_path=p32["native"][0])
    e = http_engine(native.url, "native")
    e.backend.weights_format = "fp8"  # as if the check had been skipped
    with WeightVersion(p32["fp8"][1]) as wv:
        e.load(wv)
    assert "model.layers.0.self_attn.q_proj.weight" in native.cast_silently


class _Engine:
    """Stand-in for sglang.Engine: remembers its arguments; its tokenizer manager's server_args hold the
    weight_version it started with (what SGLang stamps outputs with and update_weights_from_disk sets)."""

    started: list[dict] = []

    def __init__(self, **kwargs):
        _Engine.started.append(kwargs)
        self.kwargs = kwargs
        args = types.SimpleNamespace(weight_version=kwargs.get("weight_version", "default"))
        self.tokenizer_manager = types.SimpleNamespace(server_args=args)

    def shutdown(self) -> None:
        pass


class _Engine0514(_Engine):
    """0.5.14's (the GPU machines'): the same, with ServerArgs of other field names (FIELDS)."""


# ServerArgs fields per SGLang version (only those engine_kwargs looks at)
FIELDS = {_Engine: {"attn_dp_size", "dp_size", "tp_size"}, _Engine0514: {"enable_dp_attention", "dp_size", "tp_size"}}


@pytest.mark.parametrize("engine", [_Engine, _Engine0514], ids=["0.5.23", "0.5.14"])
def test_engine_mode_starts_sglang_on_the_first_low_bit_version(published, monkeypatch, engine):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=engine))
    monkeypatch.setattr(local, "server_args_fields", lambda: FIELDS[engine])
    _Engine.started.clear()
    paths = published("sgl", ["fp8"])["fp8"]
    cfg = load_config(None, ["model.arch.model_type=llama", "rollout.engine=sglang", "weights.formats=[fp8]",
                             "rollout.weights_format=fp8"])  # engine mode needs no model.path for a low-bit format
    b = LocalBackend(cfg, seed=3)
    assert b.engine is None and _Engine.started == []
    with pytest.raises(WeightUpdateError, match="holds weight version -1"):
        b.generate([[1]], [{}], 1, 0)
    b.update_weights(paths[0], 0)
    assert _Engine.started == [engine_kwargs(cfg, 3, model_path=paths[0], weight_version=0, fields=FIELDS[engine])]
    assert _Engine.started[0]["model_path"] == paths[0] and _Engine.started[0]["weight_version"] == "0"
    assert "quantization" not in _Engine.started[0] and b.version == 0  # SGLang reads it from config.json
    native = load_config(None, ["model.path=/m", "rollout.engine=sglang"])
    LocalBackend(native, seed=3)
    assert _Engine.started[-1]["model_path"] == "/m" and "weight_version" not in _Engine.started[-1]
