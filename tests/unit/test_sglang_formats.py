"""The SGLang adapter with pre-quantized versions (rollout.weights_format fp8 / mxfp4): http mode against
stand-in servers launched from a checkpoint (tests/sglang_fake.py holds updates to the launch parameters
as sglang 0.5.23 does, tests/fixtures/sglang/quantized_checkpoint.json), engine mode starting
`sglang.Engine` on the first version (a stand-in `sglang` module records what it is given) and again on
every later mxfp4 version, and an mxfp4 version against what sglang 0.5.14's GPT-OSS MXFP4 loader takes."""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from offpolicy.config import ConfigError, SGLangConfig, load_config
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.errors import ServerUnavailable
from offpolicy.rollout.engines.sglang import local
from offpolicy.rollout.engines.sglang.local import LocalBackend, engine_kwargs
from offpolicy.rollout.engines.sglang.servers import SGLangServers
from offpolicy.rollout.engines.sglang.wire import SGLangError, WeightUpdateError
from offpolicy.weights import WeightVersion
from tests.sglang_fake import FakeSGLang, checkpoint_params, fixture, read_back
from tests.sglang_layout import TensorUpdates
from tests.unit.test_weights_formats import GPT_OSS


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


@pytest.mark.parametrize("fmt", ["fp8", "native"])
def test_a_server_launched_from_the_formats_first_version_takes_the_next_ones(published, fakes, fmt):
    paths = published("sgl", [] if fmt == "native" else [fmt])[fmt]
    fake = fakes(model_path=paths[0])
    e = http_engine(fake.url, fmt)
    with WeightVersion(paths[1]) as wv:
        e.load(wv)
    update = [b for _, p, b in fake.calls if p == "/update_weights_from_disk"][0]
    assert update == {"model_path": paths[1], "weight_version": "1", "flush_cache": True}  # load_format: the server's
    assert fake.model_path == paths[1] and fake.cast_silently == []
    assert len(e.generate([[11, 1, 12]], SamplingParams(n=2, max_new_tokens=3))[0]) == 2


@pytest.mark.parametrize("launched, wanted", [("native", "fp8"), ("fp8", "native"), ("mxfp4", "fp8")])
def test_a_server_launched_in_another_format_is_refused_at_start(published, fakes, launched, wanted):
    mxfp4 = "mxfp4" in (launched, wanted)
    paths = published("sgl", ["fp8", "mxfp4"] if mxfp4 else ["fp8"], arch=GPT_OSS if mxfp4 else None)
    fake = fakes(model_path=paths[launched][0])
    with pytest.raises(SGLangError, match=f"a {launched} checkpoint, but rollout.weights_format is {wanted}"):
        http_engine(fake.url, wanted)
    assert "/update_weights_from_disk" not in fake.paths()


def test_mxfp4_rollouts_on_sglang_servers_are_refused_because_a_server_cannot_take_a_later_version(published,
                                                                                                    fakes):
    """SGLang repacks MXFP4 experts at launch, and the update of a later version (then its rollback) finds no
    expert parameter: the server goes down (quantized_checkpoint.json, mxfp4_reload). So the config refuses
    http mode with mxfp4, and the stand-in, driven past that check, goes down as 0.5.14 did on the GPU."""
    with pytest.raises(ConfigError, match=r"rollout.sglang.mode.*rollout.sglang.mode=engine"):
        http_engine("http://127.0.0.1:1", "mxfp4")
    paths = published("sgl", ["mxfp4"], arch=GPT_OSS)["mxfp4"]
    fake = fakes(model_path=paths[0])
    pool = SGLangServers(SGLangConfig(mode="http", urls=[fake.url], startup_timeout_s=5), weights_format="mxfp4")
    pool.wait_ready()
    with pytest.raises(ServerUnavailable):
        pool.update_weights(paths[1], 1)
    assert not fake.healthy and fake.model_path == paths[0]
    pool.close()


def _shape(dims: list, arch: dict) -> list[int]:
    """A fixture shape (`E`, `H`, `I` for experts, hidden and intermediate size, in integer expressions) for `arch`."""
    env = {"E": arch["num_local_experts"], "H": arch["hidden_size"], "I": arch["intermediate_size"]}
    return [d if isinstance(d, int) else eval(d, {"__builtins__": {}}, env) for d in dims]


def test_an_mxfp4_version_has_what_the_gpt_oss_mxfp4_loader_of_sglang_0514_reads(published):
    """Names, dtypes and shapes of every expert tensor, the views the loader takes of them, and the config
    fields (quantized_checkpoint.json, mxfp4_gpt_oss: sglang 0.5.14 models/gpt_oss.py:873-1082,
    layers/quantization/mxfp4.py:253-310, 362-507); what SGLang then does with them is the GPU run's."""
    want = fixture("quantized_checkpoint.json")["mxfp4_gpt_oss"]
    path = published("sgl", ["mxfp4"], arch=GPT_OSS)["mxfp4"][0]
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    assert config["quantization_config"]["quant_method"] == want["quant_method"]
    assert all(config[f] % 32 == 0 for f in want["multiple_of_32"])
    params = checkpoint_params(path)
    experts = sorted(n for n in params if ".experts" in n)  # what the MXFP4 loader gets (gpt_oss.py:896-903)
    expected = sorted(f"model.layers.{i}.mlp.experts.{t}" for i in range(config["num_hidden_layers"])
                      for t in want["tensors"])
    assert experts == expected
    for name in experts:
        spec = want["tensors"][name.rsplit(".", 1)[1]]
        dtype, shape = params[name]
        assert shape == _shape(spec["shape"], config), name
        assert spec["dtype"] is None or dtype == spec["dtype"], name
        if "view" in spec:  # the loader's .view(E, 2I, -1) / .view(E, -1, I / 2) must give the parameter's shape
            torch.empty(shape, dtype=torch.uint8).view(_shape(spec["view"], config))  # raises if it does not
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in params)  # no bf16 expert weight is left


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


class _Engine(TensorUpdates):
    """Stand-in for sglang.Engine: remembers its arguments and what it was asked; its tokenizer manager's
    server_args hold the weight_version (what SGLang stamps outputs with and update_weights_from_disk sets)."""

    started: list[dict] = []
    log: list[tuple] = []  # ("start", model_path) / ("update", model_path) / ("shutdown", model_path), in order

    def __init__(self, **kwargs):
        _Engine.started.append(kwargs)
        _Engine.log.append(("start", kwargs["model_path"]))
        self.kwargs, self.weights = kwargs, kwargs["model_path"]
        args = types.SimpleNamespace(weight_version=kwargs.get("weight_version", "default"))
        self.tokenizer_manager = types.SimpleNamespace(server_args=args, update_weights_from_disk=self._update,
                                                       update_weights_from_tensor=self.tensor_request)
        self.loop = types.SimpleNamespace(run_until_complete=lambda answer: answer)

    def _update(self, req, request):
        _Engine.log.append(("update", req.model_path))
        self.tokenizer_manager.server_args.weight_version = req.weight_version
        self.weights = req.model_path  # its parameters are now that checkpoint's
        return True, "Succeeded to update model weights.", 0

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return read_back(self.weights, name, truncate_size)

    def shutdown(self) -> None:
        _Engine.log.append(("shutdown", self.kwargs["model_path"]))


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


@pytest.mark.parametrize("fmt, arch", [("mxfp4", GPT_OSS), ("fp8", None)])
def test_engine_mode_starts_sglang_again_on_each_mxfp4_version_and_updates_fp8_in_place(published, monkeypatch,
                                                                                        fmt, arch):
    """mxfp4: SGLang cannot load a later MXFP4 GPT-OSS version into a running model (local.py's docstring), so
    the engine is shut down and started on it; fp8 goes through update_weights_from_disk."""
    io_struct = types.SimpleNamespace(UpdateWeightFromDiskReqInput=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_Engine))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setattr(local, "server_args_fields", lambda: FIELDS[_Engine0514])
    _Engine.started.clear()
    _Engine.log.clear()
    paths = published("sgl", [fmt], versions=3, arch=arch)[fmt]
    cfg = load_config(None, ["rollout.engine=sglang", f"weights.formats=[{fmt}]", f"rollout.weights_format={fmt}"]
                      + (["model.arch=" + json.dumps(arch)] if arch else ["model.arch.model_type=llama"]))
    b = LocalBackend(cfg, seed=3)
    for v, path in enumerate(paths):
        b.update_weights(path, v)
        assert b.version == v and b.engine.tokenizer_manager.server_args.weight_version == str(v)
    if fmt == "mxfp4":
        assert _Engine.log == [("start", paths[0]), ("shutdown", paths[0]), ("start", paths[1]),
                               ("shutdown", paths[1]), ("start", paths[2])]
        assert [k["weight_version"] for k in _Engine.started] == ["0", "1", "2"]
        assert _Engine.started[2] == engine_kwargs(cfg, 3, model_path=paths[2], weight_version=2,
                                                   fields=FIELDS[_Engine0514])
    else:
        assert _Engine.log == [("start", paths[0]), ("update", paths[1]), ("update", paths[2])]


@pytest.mark.parametrize("setting, restarts", [("auto", True), ("inplace", False)])
def test_an_mxfp4_version_refused_in_place_makes_auto_restart_the_engine_from_then_on(published, monkeypatch, setting,
                                                                                       restarts):
    """`rollout.sglang.mxfp4_load: auto` on a GPU (here: the in-place decision and the direct reads forced on the
    CPU): a version whose in-place load is refused (here SGLang is handed no tensors) makes every later one restart
    the engine, as vLLM's engine rebuilds after a failed in-place load; an explicit `inplace` keeps loading in place
    (and failing)."""
    io_struct = types.SimpleNamespace(UpdateWeightFromDiskReqInput=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_Engine))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setattr(local, "server_args_fields", lambda: FIELDS[_Engine0514])
    monkeypatch.setattr(local, "mxfp4_in_place", lambda cfg: True)
    monkeypatch.setattr(local, "unstaged_of", lambda cfg: "direct")
    monkeypatch.setattr(local, "prefetch_of", lambda cfg: "direct")
    monkeypatch.setattr(local, "direct_requests", lambda *args, **kwargs: iter(()))  # a write SGLang refuses
    _Engine.started.clear()
    _Engine.log.clear()
    paths = published("sgl", ["mxfp4"], versions=3, arch=GPT_OSS)["mxfp4"]
    cfg = load_config(None, ["rollout.engine=sglang", "weights.formats=[mxfp4]", "rollout.weights_format=mxfp4",
                             "model.arch=" + json.dumps(GPT_OSS), f"rollout.sglang.mxfp4_load={setting}"])
    b = LocalBackend(cfg, seed=3)
    assert b.tensor_loader is not None and not b.restart
    assert not b.stages_ahead()  # nothing staged before the first version has started the engine
    b.update_weights(paths[0], 0)  # the start
    assert b.stages_ahead()  # later versions are staged ahead into the running engine
    closed = []
    b.staged = types.SimpleNamespace(held=lambda path: contextlib.nullcontext((None, None)),
                                     close=lambda: closed.append(True))  # StagedLoads' stand-in: nothing staged
    with pytest.raises(WeightUpdateError, match="refused weight version 1"):
        b.update_weights(paths[1], 1)
    assert b.restart is restarts and (b.tensor_loader is None) is restarts
    assert b.stages_ahead() is not restarts and bool(closed) is restarts  # restarts: the staging's memory given back
    _Engine.log.clear()
    if restarts:
        b.update_weights(paths[2], 2)
        assert b.version == 2 and _Engine.log == [("shutdown", paths[0]), ("start", paths[2])]
    else:
        with pytest.raises(WeightUpdateError, match="refused weight version 2"):
            b.update_weights(paths[2], 2)
        assert _Engine.log == []  # no restart


def test_fp8_versions_outside_128_blocks_start_sglang_on_its_triton_block_gemm(published):
    """DeepGEMM and CUTLASS (SGLang's auto picks on Hopper) take 128 x 128 blocks only (local.py's docstring): an fp8
    version in other blocks starts the engine on the Triton block GEMM, unless rollout.sglang.extra names a backend;
    a 128 x 128 version, mxfp4 and a SGLang without the field keep SGLang's choice."""
    b32, b128 = published("b32", ["fp8"])["fp8"][0], published("b128", ["fp8"], block=(128, 128))["fp8"][0]
    mx = published("mx", ["mxfp4"], arch=GPT_OSS)["mxfp4"][0]
    cfg = load_config(None, ["model.arch.model_type=llama", "rollout.engine=sglang", "weights.formats=[fp8]",
                             "rollout.weights_format=fp8"])
    fields = {"tp_size", "dp_size", "attn_dp_size", "fp8_gemm_runner_backend"}
    assert engine_kwargs(cfg, 0, model_path=b32, weight_version=0, fields=fields)["fp8_gemm_runner_backend"] == "triton"
    assert engine_kwargs(cfg, 0, model_path=b32, weight_version=0)["fp8_gemm_runner_backend"] == "triton"  # 0.5.23
    assert "fp8_gemm_runner_backend" not in engine_kwargs(cfg, 0, model_path=b128, weight_version=0, fields=fields)
    assert "fp8_gemm_runner_backend" not in engine_kwargs(cfg, 0, model_path=mx, weight_version=0, fields=fields)
    assert "fp8_gemm_runner_backend" not in engine_kwargs(cfg, 0, model_path=b32, weight_version=0,
                                                          fields=fields - {"fp8_gemm_runner_backend"})
    chosen = load_config(None, ["model.arch.model_type=llama", "rollout.engine=sglang", "weights.formats=[fp8]",
                                "rollout.weights_format=fp8", "rollout.sglang.extra.fp8_gemm_runner_backend=deep_gemm"])
    assert engine_kwargs(chosen, 0, model_path=b32, weight_version=0)["fp8_gemm_runner_backend"] == "deep_gemm"
