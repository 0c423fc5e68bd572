"""The proof of SGLang weight loads (offpolicy/rollout/engines/sglang/proof.py): SGLang's own read-back,
get_weights_by_name, of a few unfused tensors compared exactly with the version's files.

Real versions of the quickstart's tiny Llama (and GPT-OSS) are published by the Publisher (tests/conftest.py
`published`, each version's weights moved from the last); the stand-ins serve
get_weights_by_name from the files of the checkpoint they last loaded, as SGLang 0.5.14's Llama does
(tests/sglang_fake.py `read_back`): over HTTP the stand-in server, in process a stand-in `sglang.Engine`.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from offpolicy.config import SGLangConfig, load_config
from offpolicy.rollout.engines import SamplingParams, make_engine
from offpolicy.rollout.engines.errors import ServerUnavailable, VersionRefused, WeightUpdateError
from offpolicy.rollout.engines.sglang import proof
from offpolicy.rollout.engines.sglang.proof import Expected, Sample, expect, prove, sample_names
from offpolicy.rollout.engines.sglang.servers import SGLangServers
from offpolicy.weights import WeightVersion
from tests.sglang_fake import FakeSGLang, read_back
from tests.sglang_layout import TensorUpdates, install
from tests.unit.test_weights_formats import GPT_OSS

LLAMA5 = "model.arch.num_hidden_layers=5"  # the quickstart's model with 5 layers


@pytest.fixture
def fakes():
    made: list[FakeSGLang] = []

    def make(n: int = 1, **kw) -> list[FakeSGLang]:
        made.extend(FakeSGLang(**kw) for _ in range(n))
        return made[-n:]

    yield make
    for f in made:
        if f.thread.is_alive():
            f.stop()


def http_engine(*urls: str, fmt: str = "native"):
    return make_engine(load_config(None, [
        "model.arch.model_type=llama", "rollout.engine=sglang", "rollout.sglang.mode=http",
        f"rollout.sglang.urls=[{', '.join(urls)}]", "rollout.sglang.startup_timeout_s=5", "weights.formats=[fp8]",
        f"rollout.weights_format={fmt}"]))


def load(engine, path: str) -> list[dict]:
    with WeightVersion(path) as wv:
        engine.load(wv)
    return engine.last_loads


def read_backs(fake: FakeSGLang) -> list[dict]:
    return [body for _, p, body in fake.calls if p == "/get_weights_by_name"]


# --- what is read back --------------------------------------------------------------------------------------------


def test_the_sampled_tensors_are_unfused_unquantized_ones_of_the_first_middle_and_last_layers(published, monkeypatch):
    paths = published("five", ["fp8"], versions=1, arch=LLAMA5, moved=True)
    layers = [f"model.layers.{i}.{n}" for i in (0, 2, 4) for n in ("input_layernorm.weight",
                                                                   "post_attention_layernorm.weight")]
    with WeightVersion(paths["native"][0]) as wv:
        names = dict(sample_names(wv.tensors))
    assert sorted(names) == sorted(["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight", *layers,
                                    *(f"model.layers.{i}.self_attn.o_proj.weight" for i in (0, 2, 4))])
    assert [n for n, linear in names.items() if linear] == [f"model.layers.{i}.self_attn.o_proj.weight"
                                                           for i in (0, 2, 4)]
    with WeightVersion(paths["fp8"][0]) as wv:  # its linear weights are fp8: left out; embeddings and norms stay
        assert wv.tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
        assert sorted(n for n, _ in sample_names(wv.tensors)) == sorted(
            ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight", *layers])
    e = expect(paths["native"][0], 0)
    o_proj, norm = e.of("model.layers.0.self_attn.o_proj.weight"), e.of("model.norm.weight")
    assert (e.version, o_proj.rows, tuple(o_proj.values.shape), norm.rows) == (0, 64, (64, 64), 64)
    # SGLang answers TP rank 0's vocabulary shard: at most 1/16 of the rows (of 16 here: one)
    assert tuple(e.of("model.embed_tokens.weight").values.shape) == (1, 64) == tuple(e.of("lm_head.weight").values.shape)
    monkeypatch.setattr(proof, "READ_VALUES", 130)  # two rows of 64 values; a 1-D tensor: its first 130 values
    assert expect(paths["native"][0], 0).of("model.layers.0.self_attn.o_proj.weight").rows == 2
    assert expect(paths["native"][0], 0).of("model.norm.weight").rows == 64
    monkeypatch.setattr(proof, "MAX_ELEMENTS", 64)  # SGLang lists a whole parameter: large ones are left out
    assert sorted(s.name for s in expect(paths["fp8"][0], 0).samples) == sorted(["model.norm.weight", *layers])


def test_data_parallel_answers_and_a_16_bit_engine_of_float32_files(published):
    """With dp_size > 1 SGLang answers one parameter per DP rank (each must match); an engine that keeps the model
    in bfloat16 holds a float32 file's values rounded, which match too; anything else fails, naming the tensor."""
    values = torch.tensor([[1.0, 2.0 + 2 ** -20], [3.0, 4.0]])
    e = Expected(3, "/v3", [Sample("model.norm.weight", 2, values)])
    assert prove(e, lambda n, r: [values.tolist()] * 2, {}, "here")["verified"]
    assert prove(e, lambda n, r: values.to(torch.bfloat16).float().tolist(), {}, "here")["verified"]
    with pytest.raises(WeightUpdateError, match=r"here: after loading weight version 3 from /v3 .*model.norm.weight "
                                                r"differs .* at element 1 .*\(2.5, the file 2.00000095"):
        prove(e, lambda n, r: [values.tolist(), [[1.0, 2.5], [3.0, 4.0]]], {}, "here")
    with pytest.raises(WeightUpdateError, match=r"answered shape \(1, 2\)"):
        prove(e, lambda n, r: values.tolist()[:1], {}, "here")


# --- servers over HTTP ------------------------------------------------------------------------------------------


def test_each_load_into_the_servers_is_proven_by_reading_its_tensors_back(published, fakes):
    paths = published("sgl", [], versions=3, moved=True)["native"]
    a, b = fakes(2)
    e = http_engine(a.url, b.url)
    for v, path in enumerate(paths):
        records = load(e, path)
        assert e.version == v and sorted(r["url"] for r in records) == sorted([a.url, b.url])
        for r in records:
            assert r["method"] == "disk" and r["verified"] and r["seconds"] >= r["proof_seconds"] > 0
            assert r["tensors"] == [s.name for s in expect(path, v).samples] and r["changed"] == r["tensors"]
    asked = read_backs(a)
    assert len(asked) == 3 * 9  # 3 model tensors, 2 layers x (2 norms + o_proj), per version
    assert {"name": "model.norm.weight", "truncate_size": 64} in asked  # the whole norm
    assert {"name": "model.embed_tokens.weight", "truncate_size": 1} in asked  # 1 row of 64 values (1/16 of 16)
    paths_a = a.paths()
    assert paths_a.index("/get_weights_by_name") > paths_a.index("/model_info", paths_a.index("/continue_generation"))


def test_a_server_that_keeps_the_old_tensors_fails_the_load_naming_them(published, fakes):
    paths = published("sgl", [], versions=3, moved=True)["native"]
    good, bad = fakes(2)
    e = http_engine(good.url, bad.url)
    load(e, paths[0])
    bad.keep_weights = True  # SGLang answers success and moves its weight_version, the parameters stay
    with pytest.raises(WeightUpdateError, match=rf"{bad.url}: after loading weight version 1 from {paths[1]} the "
                                                r"tensors SGLang reads back are not the version's: model.norm.weight "
                                                r"differs .*\(it still holds version 0's values\)"):
        load(e, paths[1])
    assert e.version == 0 and bad.weight_version == "1"
    assert {s.url: s.version for s in e.backend.servers} == {good.url: 1, bad.url: None}  # it takes no work
    assert e.backend.swaps == [r for r in e.backend.swaps if r["url"] == good.url]  # the good one's, for later
    bad.keep_weights = False
    records = load(e, paths[2])
    assert e.version == 2 and len(records) == 3 and all(r["verified"] for r in records)


def test_a_model_without_read_back_loads_unproven_and_is_not_asked_again(published, fakes):
    """GPT-OSS and Qwen have no get_weights_by_name in SGLang 0.5.14: every name answers 400 "Get parameter by name
    failed". On a server launched without offpolicy's fingerprint loader the loads go on, recorded unproven with why
    (both); the server is not asked again."""
    paths = published("sgl", [], versions=2, moved=True)["native"]
    (fake,) = fakes()
    fake.readback, fake.custom_weight_loader = False, []
    e = http_engine(fake.url)
    (r,) = load(e, paths[0])
    assert not r["verified"] and "no get_weights_by_name" in r["why"] and e.version == 0
    assert "was not started with offpolicy's fingerprint loader" in r["why"] and "--custom-weight-loader" in r["why"]
    asked = len(read_backs(fake))
    assert asked == 9
    (r,) = load(e, paths[1])
    assert not r["verified"] and e.version == 1 and len(read_backs(fake)) == asked


def test_a_server_that_stops_answering_its_read_back_fails_the_load(published, fakes):
    paths = published("sgl", [], versions=2, moved=True)["native"]
    (fake,) = fakes()
    e = http_engine(fake.url)
    assert load(e, paths[0])[0]["verified"]
    fake.readback = False
    with pytest.raises(WeightUpdateError, match="get_weights_by_name answered nothing .* which it read back before"):
        load(e, paths[1])
    assert e.version == 0
    # it takes no work with unknown weights: generate's wait for a server loads version 0 onto it, unproven as well
    with pytest.raises(WeightUpdateError, match="refused weight version 0.*answered nothing"):
        e.generate([[11, 1, 12]], SamplingParams(n=1, max_new_tokens=2))


def test_a_version_whose_sampled_tensors_did_not_change_is_unproven(published, fakes):
    paths = published("sgl", [], versions=2, moved=False)["native"]
    (fake,) = fakes()
    e = http_engine(fake.url)
    assert load(e, paths[0])[0]["verified"]  # the first version: nothing to tell it from
    (r,) = load(e, paths[1])
    assert not r["verified"] and "cannot tell this load from none" in r["why"] and r["changed"] == []


def test_a_server_that_quantizes_online_is_read_back_without_its_linear_weights(published, fakes):
    paths = published("sgl", [], versions=1, moved=True)["native"]
    (fake,) = fakes()
    fake.quantization = "fp8"  # launched with --quantization fp8: its o_proj is fp8, not the file's
    e = http_engine(fake.url)
    (r,) = load(e, paths[0])
    assert r["verified"] and not any("o_proj" in n for n in r["tensors"]) and len(r["tensors"]) == 7
    assert fake.paths().count("/server_info") == 1


def test_fp8_versions_are_proven_by_their_unquantized_tensors(published, fakes):
    paths = published("sgl", ["fp8"], versions=2, moved=True)["fp8"]
    (fake,) = fakes(model_path=paths[0])
    e = http_engine(fake.url, fmt="fp8")
    for v in (0, 1):
        (r,) = load(e, paths[v])
        assert r["verified"] and len(r["tensors"]) == 7 and not any("o_proj" in n for n in r["tensors"])


def test_a_version_whose_files_cannot_be_read_is_refused_before_any_server_is_touched(published, fakes):
    paths = published("sgl", [], versions=2, moved=True)["native"]
    (fake,) = fakes()
    e = http_engine(fake.url)
    load(e, paths[0])
    for shard in Path(paths[1]).glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(VersionRefused, match=rf"weight version 1 at {paths[1]} cannot be read .*FileNotFoundError"):
        load(e, paths[1])
    assert e.version == 0 and fake.paths().count("/update_weights_from_disk") == 1
    assert len(e.generate([[11, 1, 12]], SamplingParams(n=1, max_new_tokens=2))) == 1  # version 0 still serves


def test_the_pool_alone_proves_its_loads(published, fakes):
    """SGLangServers.update_weights finds what to read back in the version's files itself, and records each load."""
    paths = published("sgl", [], versions=3, moved=True)["native"]
    (fake,) = fakes(model_path=paths[0])
    pool = SGLangServers(SGLangConfig(mode="http", urls=[fake.url], startup_timeout_s=5))
    pool.wait_ready()
    pool.update_weights(paths[1], 1)
    assert [(r["url"], r["verified"]) for r in pool.swaps] == [(fake.url, True)]
    fake.keep_weights = True
    with pytest.raises(WeightUpdateError, match=r"model.norm.weight differs .*\(it still holds version 1's values\)"):
        pool.update_weights(paths[2], 2)
    assert pool.servers[0].version is None and len(pool.swaps) == 1
    pool.close()


# --- sglang.Engine in process -----------------------------------------------------------------------------------


class _Engine(TensorUpdates):
    """Stand-in for sglang.Engine whose parameters are the tensors of the checkpoint it last loaded."""

    keep = False  # updates succeed and the parameters stay

    def __init__(self, **kwargs):
        self.kwargs, self.weights = kwargs, kwargs["model_path"]
        args = types.SimpleNamespace(weight_version=kwargs.get("weight_version", "default"))
        self.tokenizer_manager = types.SimpleNamespace(server_args=args, update_weights_from_disk=self._update,
                                                       update_weights_from_tensor=self.tensor_request)
        self.loop = types.SimpleNamespace(run_until_complete=lambda answer: answer)
        self.asked: list[str] = []

    def _update(self, req, request):
        self.tokenizer_manager.server_args.weight_version = req.weight_version
        if not _Engine.keep:
            self.weights = req.model_path
        return True, "Succeeded to update model weights.", 0

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        self.asked.append(name)
        return read_back(self.weights, name, truncate_size)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def sglang_module(monkeypatch):
    install(monkeypatch, _Engine, {"dp_size", "tp_size", "attn_dp_size"})
    monkeypatch.setattr(_Engine, "keep", False)


def engine_mode(*overrides: str):
    return make_engine(load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=engine", *overrides]))


def test_the_in_process_engine_proves_each_load_and_fails_one_that_keeps_old_tensors(published, sglang_module):
    paths = published("sgl", [], versions=3, moved=True)["native"]
    e = engine_mode("model.arch.model_type=llama", f"model.path={paths[0]}")
    for v in (0, 1):
        (r,) = load(e, paths[v])
        assert r["method"] == "disk" and r["verified"] and len(r["tensors"]) == 9 and "url" not in r
    _Engine.keep = True
    with pytest.raises(WeightUpdateError, match=r"the in-process SGLang engine: .* model.norm.weight differs .*"
                                                r"\(it still holds version 1's values\)"):
        load(e, paths[2])
    assert e.version == 1 and e.backend.version is None  # it generates no more until a load succeeds
    with pytest.raises(WeightUpdateError, match="holds weight version None"):
        e.backend.generate([[1]], [{}], 1, 1)
    _Engine.keep = False
    assert load(e, paths[2])[0]["verified"] and e.version == 2


@pytest.mark.parametrize("fmt, arch", [("fp8", None), ("mxfp4", GPT_OSS)])
def test_low_bit_starts_and_restarts_are_proven_where_the_model_reads_back(published, sglang_module, fmt, arch):
    """fp8: the start on the first version and each update, proven by the unquantized tensors; mxfp4 (GPT-OSS, whose
    SGLang model has no get_weights_by_name, on an SGLang whose ServerArgs has no custom_weight_loader: no fingerprint
    either, test_sglang_fingerprint_proof.py has it): each (re)start recorded unproven, the engine asked once only."""
    paths = published("sgl", [fmt], versions=3, arch=arch, moved=True)[fmt]
    e = engine_mode(f"weights.formats=[{fmt}]", f"rollout.weights_format={fmt}",
                    "model.arch=" + json.dumps(arch) if arch else "model.arch.model_type=llama")
    records = [load(e, p)[0] for p in paths]
    if fmt == "fp8":
        assert [r["method"] for r in records] == ["start", "disk", "disk"] and all(r["verified"] for r in records)
    else:
        assert [r["method"] for r in records] == ["start", "restart", "restart"]
        assert not any(r["verified"] for r in records) and "no get_weights_by_name" in records[-1]["why"]
        assert e.backend.engine.asked == []  # the third engine was not asked: the model class has none
    assert e.version == 2
