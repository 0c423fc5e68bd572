"""Tests for offpolicy.weights.formats and .broadcast: a version published natively and in fp8 / mxfp4
(layout, manifests, config.json, bytes), collection per format, a resumed learner's partial version,
`subscribe` on a format's store, `decode`, the torch engine loading each format, and transformers
loading the published fp8 and mxfp4 directories."""

from __future__ import annotations

import json

import pytest
import torch

from offpolicy.config import ModelConfig, WeightsConfig, load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightVersion, list_versions, subscribe, version_dir
from offpolicy.weights.formats import decode, encode, store_run
from offpolicy.weights.publisher import Publisher
from offpolicy.weights.store import read_manifest
from tests.conftest import QUICKSTART

GPT_OSS = dict(model_type="gpt_oss", vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64, sliding_window=32, layer_types=["sliding_attention", "full_attention"],
               bos_token_id=11, eos_token_id=13, pad_token_id=10)


def quickstart(*overrides: str):
    return load_config(QUICKSTART, ["rollout.device=cpu", "learner.device=cpu", *overrides])


def publisher(root, formats, **kw) -> Publisher:
    return Publisher(WeightsConfig(root=str(root), keep=2, formats=formats, **kw), "run")


def test_each_format_is_a_store_of_its_own_with_its_manifest_and_quantization_config(tmp_path):
    model = build_model(quickstart().model, torch.device("cpu"))
    b = publisher(tmp_path, ["fp8"], fp8_block_size=(64, 64))
    calls = []
    pub = b.publish(0, lambda: calls.append(1) or hf_state(model), hf_config(model))
    assert calls == [1] and pub.path == str(tmp_path / "run" / "v0")
    assert store_run("run", "fp8") == "run/fp8" and store_run("run", "native") == "run"
    native, low = read_manifest(tmp_path / "run" / "v0"), read_manifest(tmp_path / "run" / "fp8" / "v0")
    assert (native.format, low.format) == ("native", "fp8")
    qc = json.loads((tmp_path / "run" / "fp8" / "v0" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [64, 64]
    assert qc["ignored_layers"] == ["lm_head", "model.embed_tokens"]
    assert "quantization_config" not in json.loads((tmp_path / "run" / "v0" / "config.json").read_text())
    # float32 quickstart: the attention and MLP projections shrink 4x (+ 1 scale per 64x64 block); the rest stays
    proj = sum(t.numel() for n, t in hf_state(model) if n.endswith("proj.weight"))
    assert low.total_bytes == native.total_bytes - 3 * proj + 4 * proj // 4096
    assert [(f.fmt, f.total_bytes) for f in b.last] == [("native", native.total_bytes), ("fp8", low.total_bytes)]
    assert list_versions(tmp_path, "run") == [0] and list_versions(tmp_path, "run/fp8") == [0]


def test_a_version_is_committed_when_its_first_format_is_renamed_into_place(tmp_path):
    """Published.committed: the wall time just before the first format's directory appeared (the run's timeline ends
    the publish span there, since a rollout scanning the store may find it before the announcement)."""
    import time

    model = build_model(quickstart().model, torch.device("cpu"))
    b = publisher(tmp_path, ["fp8"], fp8_block_size=(64, 64))
    before = time.time()
    pub = b.publish(0, lambda: hf_state(model), hf_config(model))
    after = time.time()
    native, fp8 = (f.committed for f in b.last)
    assert before <= native < fp8 <= after  # the native store is written first, then fp8
    assert pub.committed == native
    assert version_dir(tmp_path, "run", 0).stat().st_ctime >= native - 0.05  # renamed after it (coarse fs clock)
    held = b.publish(0, lambda: hf_state(model), hf_config(model))  # nothing written again: no commit time
    assert held.committed == 0.0


def test_collection_resume_and_drop_after_act_on_every_format(tmp_path):
    model = build_model(quickstart().model, torch.device("cpu"))
    b = publisher(tmp_path, ["fp8"])
    for v in range(4):
        b.publish(v, lambda: hf_state(model), hf_config(model))
    assert list_versions(tmp_path, "run") == [2, 3] and list_versions(tmp_path, "run/fp8") == [2, 3]
    # a learner that died between the native and the fp8 write: the next publish writes only what is missing
    b2 = publisher(tmp_path, ["fp8"])
    b2.native.publish(4, hf_state(model), hf_config(model))
    pub = b2.publish(4, lambda: hf_state(model), hf_config(model))
    assert list_versions(tmp_path, "run/fp8") == [3, 4] and pub.total_bytes == read_manifest(pub.path).total_bytes
    assert b2.publish(4, lambda: pytest.fail("gathered although every format holds the version"), {}).seconds == 0.0
    assert b2.drop_after(3) == [4]
    assert list_versions(tmp_path, "run") == [3] and list_versions(tmp_path, "run/fp8") == [3]


def test_native_versions_only_where_native_at_says_so(tmp_path):
    """weights.native=checkpoints (the learner's `native_at`: the versions a checkpoint exports): the low-bit store
    gets every version, the native one only those; the announced version is then the low-bit one's, and a later
    call for a version that has every wanted format gathers nothing."""
    model = build_model(quickstart().model, torch.device("cpu"))
    b = Publisher(WeightsConfig(root=str(tmp_path), keep=5, formats=["fp8"], native="checkpoints"), "run",
                  native_at=lambda v: v % 2 == 0)
    pubs = [b.publish(v, lambda: hf_state(model), hf_config(model)) for v in range(4)]
    assert list_versions(tmp_path, "run") == [0, 2] and list_versions(tmp_path, "run/fp8") == [0, 1, 2, 3]
    assert pubs[0].path == str(tmp_path / "run" / "v0") and pubs[1].path == str(tmp_path / "run" / "fp8" / "v1")
    assert pubs[1].total_bytes == read_manifest(tmp_path / "run" / "fp8" / "v1").total_bytes
    assert [f.fmt for f in b.last] == ["native", "fp8"] and b.last[0].total_bytes == 0
    assert b.missing(3) == [] and b.missing(4) == ["native", "fp8"] and b.missing(5) == ["fp8"]
    assert b.publish(3, lambda: pytest.fail("gathered although every wanted format holds it"), {}).seconds == 0.0


def test_subscribe_follows_a_formats_store(tmp_path):
    model = build_model(quickstart().model, torch.device("cpu"))
    b = publisher(tmp_path, ["fp8"])
    b.publish(0, lambda: hf_state(model), hf_config(model))
    b.publish(1, lambda: hf_state(model), hf_config(model))
    got = [(wv.version, wv.manifest.format) for wv in subscribe(str(tmp_path), "run/fp8", latest_only=False,
                                                                timeout_s=0.3, poll_s=0.05)]
    assert got == [(0, "fp8"), (1, "fp8")]


def test_decode_gives_native_names_shapes_and_close_values(tmp_path):
    model = build_model(quickstart().model, torch.device("cpu"))
    b = publisher(tmp_path, ["fp8"], fp8_block_size=(32, 32))
    b.publish(0, lambda: hf_state(model), hf_config(model))
    own = dict(hf_state(model))
    with WeightVersion(version_dir(tmp_path, "run/fp8", 0)) as wv:
        out = dict(decode(wv, torch.float32))
    assert set(out) == set(own)
    for name, t in own.items():
        assert out[name].shape == t.shape and out[name].dtype == torch.float32
        tol = t.abs().max() * 2 ** -4 if name.endswith("proj.weight") else 0
        assert (out[name] - t).abs().max() <= tol, name


def test_mxfp4_needs_gpt_oss_experts():
    model = build_model(quickstart().model, torch.device("cpu"))
    with pytest.raises(ValueError, match="mxfp4 quantizes GPT-OSS MoE experts"):
        encode("mxfp4", hf_state(model), hf_config(model))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_torch_engine_loads_a_low_bit_version_dequantized(tmp_path, fmt):
    arch = ["model.arch=" + json.dumps(GPT_OSS)] if fmt == "mxfp4" else []
    cfg = quickstart(*arch, "model.seed=5")
    src = build_model(cfg.model, torch.device("cpu"))
    b = publisher(tmp_path, [fmt], fp8_block_size=(32, 32))
    b.publish(7, lambda: hf_state(src), hf_config(src))
    engine = TorchEngine(quickstart(*arch), seed=0)
    with WeightVersion(version_dir(tmp_path, store_run("run", fmt), 7)) as wv:
        want = dict(decode(wv, torch.float32))
        engine.load(wv)
    assert engine.version == 7
    state = dict(hf_state(engine.model))
    for name, t in want.items():
        assert torch.equal(state[name], t), name
    src_state = dict(hf_state(src))
    err = max(((state[n] - t).abs().max() / t.abs().max().clamp_min(1e-12)).item() for n, t in src_state.items())
    assert 0 < err <= (1 / 3 if fmt == "mxfp4" else 2 ** -4)
    params = SamplingParams(n=2, top_k=1, max_new_tokens=4)
    assert len(engine.generate([[11, 1, 2, 12]], params)[0]) == 2


def test_transformers_loads_published_fp8_and_mxfp4_directories(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    dense = build_model(quickstart().model, torch.device("cpu"))
    moe = build_model(ModelConfig(arch=GPT_OSS, seed=1), torch.device("cpu"))
    publisher(tmp_path / "d", ["fp8"], fp8_block_size=(64, 64)).publish(0, lambda: hf_state(dense), hf_config(dense))
    publisher(tmp_path / "m", ["mxfp4"]).publish(0, lambda: hf_state(moe), hf_config(moe))
    for root, fmt, qc in ((tmp_path / "d", "fp8", transformers.FineGrainedFP8Config(dequantize=True)),
                          (tmp_path / "m", "mxfp4", transformers.Mxfp4Config(dequantize=True))):
        path = version_dir(root, store_run("run", fmt), 0)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, quantization_config=qc)
        with WeightVersion(path) as wv:
            want = dict(decode(wv, torch.float32))
        state = loaded.state_dict()
        for name, t in want.items():
            assert torch.equal(state[name], t), (fmt, name)
