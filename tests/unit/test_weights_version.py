"""Tests for offpolicy/weights/version.py and safetensors_view.py: `WeightVersion`'s zero-copy views on the
shards' maps, the safetensors view's dtypes and refusals, verification against the manifest, and loading a
published version with HF `transformers`."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from offpolicy.config import load_config
from offpolicy.models.build import build_model, hf_config, hf_state
from offpolicy.weights import ChecksumError, WeightStore, WeightVersion, list_versions
from offpolicy.weights.safetensors_view import map_tensors
from tests.weight_stores import RUN, publish, sha256, small_tensors

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


# ---------------------------------------------------------------- WeightVersion: zero-copy views


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == str(path):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_tensors_are_views_on_a_map_of_the_shard(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    pub = publish(store, 0)
    shard = (Path(pub.path) / "model-00001-of-00001.safetensors").resolve()
    with WeightVersion(pub.path) as wv:
        tensors = wv.tensors
        ranges = _mapped_ranges(shard)
        assert ranges, "the shard is not memory-mapped"
        for name, t in tensors.items():
            ptr = t.untyped_storage().data_ptr()
            assert any(lo <= ptr and ptr + t.numel() * t.element_size() <= hi for lo, hi in ranges), name
        assert tensors is wv.tensors  # mapped once, on first access


def test_two_readers_see_the_same_data_and_writes_stay_private(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    pub = publish(store, 0)
    expected = small_tensors(0)
    shard = Path(pub.path) / "model-00001-of-00001.safetensors"
    digest = sha256(shard)
    a, b = WeightVersion(pub.path), WeightVersion(pub.path)
    try:
        for k, t in expected.items():
            assert torch.equal(a.tensors[k], t) and torch.equal(b.tensors[k], t)
        a.tensors["lm_head.weight"].fill_(123.0)  # copy-on-write: only this reader's map changes
        assert torch.all(a.tensors["lm_head.weight"] == 123.0)
        assert torch.equal(b.tensors["lm_head.weight"], expected["lm_head.weight"])
    finally:
        a.close()
        b.close()
    assert sha256(shard) == digest
    with WeightVersion(pub.path, verify=True) as c:
        assert torch.equal(c.tensors["lm_head.weight"], expected["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool])
def test_map_tensors_round_trips_dtypes_exactly(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        base = torch.randn(5, 7, generator=g) * 1e3
        base[0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
        t = base.to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(5, 7, generator=g) > 0.5
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (5, 7), generator=g, dtype=dtype)
        t[0, 0], t[0, 1] = info.min, info.max
    tensors = {"a": t, "scalar": t[1, 1].clone(), "empty": t[:0].clone(), "transposed": t.t()}
    path = tmp_path / "x.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    out = map_tensors(path)
    assert out.keys() == tensors.keys()
    for k, v in tensors.items():
        assert out[k].dtype == dtype and out[k].shape == v.shape, k
        if dtype.is_floating_point:  # bitwise: -0.0 and inf included
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
            assert torch.equal(out[k].contiguous().view(bits), v.contiguous().view(bits)), k
        assert torch.equal(out[k], v), k


def test_store_round_trips_mixed_dtypes_through_weight_version(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(7, generator=g).to(torch.float16),
        "fp32": torch.randn(2, 3, 4, generator=g),
        "i64": torch.arange(-5, 6, dtype=torch.int64) * (1 << 40),
        "noncontig": torch.randn(6, 4, generator=g).t(),
    }
    store = WeightStore(str(tmp_path), RUN, shard_bytes=200)
    pub = publish(store, 0, tensors)
    with WeightVersion(pub.path, verify=True) as wv:
        assert wv.tensors.keys() == tensors.keys()
        for k, t in tensors.items():
            assert wv.tensors[k].dtype == t.dtype and torch.equal(wv.tensors[k], t), k


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_map_tensors_rejects_inconsistent_offsets_and_unknown_dtypes(tmp_path):
    ok = tmp_path / "ok.safetensors"
    _write_raw_safetensors(ok, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    assert torch.equal(map_tensors(ok)["a"], torch.zeros(2))

    short = tmp_path / "short.safetensors"
    _write_raw_safetensors(short, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="inconsistent offsets"):
        map_tensors(short)

    wrong = tmp_path / "wrong.safetensors"
    _write_raw_safetensors(wrong, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="inconsistent offsets"):
        map_tensors(wrong)

    odd = tmp_path / "odd.safetensors"
    _write_raw_safetensors(odd, {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="unsupported dtype"):
        map_tensors(odd)


# ---------------------------------------------------------------- verification


def test_verify_passes_for_a_good_version_and_catches_a_flipped_byte(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=1, shard_bytes=600)
    pub = publish(store, 0)
    with WeightVersion(pub.path, verify=True) as wv:
        wv.verify()
    shard = sorted(Path(pub.path).glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of tensor data: same size, different hash
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    WeightVersion(pub.path).close()  # without verify it opens
    with pytest.raises(ChecksumError, match="sha256"):
        WeightVersion(pub.path, verify=True)
    assert issubclass(ChecksumError, ValueError)
    # a refused version is not held: the collector can remove it
    publish(store, 1)
    assert list_versions(tmp_path, RUN) == [1]


def test_verify_catches_truncated_and_missing_files(tmp_path):
    store = WeightStore(str(tmp_path), RUN, keep=5, checksum="none")
    a, b = publish(store, 0), publish(store, 1)
    shard = Path(a.path) / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ChecksumError, match="bytes"):
        WeightVersion(a.path, verify=True)
    (Path(b.path) / "config.json").unlink()
    with pytest.raises(ChecksumError):
        WeightVersion(b.path, verify=True)


def test_verify_catches_an_edited_config(tmp_path):
    store = WeightStore(str(tmp_path), RUN)
    pub = store.publish(0, iter(small_tensors().items()), {"model_type": "llama", "hidden_size": 8})
    cfg = Path(pub.path) / "config.json"
    cfg.write_text(cfg.read_text().replace("llama", "LLAMA"))  # same size
    with pytest.raises(ChecksumError, match="config.json"):
        WeightVersion(pub.path, verify=True)


# ---------------------------------------------------------------- HF loads a published version


def test_transformers_loads_a_published_tiny_llama_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(QUICKSTART, [])
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(str(tmp_path), RUN, shard_bytes=100_000)  # sharded, with an index
    pub = store.publish(0, hf_state(model), hf_config(model))
    assert len(list(Path(pub.path).glob("*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(pub.path).eval()
    assert type(loaded) is type(model)
    assert set(loaded.state_dict()) == set(model.state_dict())
    tokens = torch.tensor([[11, 1, 2, 3, 4, 12, 1, 2], [11, 9, 8, 7, 6, 12, 9, 13]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_transformers_loads_a_tied_model_published_without_the_duplicate(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(QUICKSTART, ["model.arch.tie_word_embeddings=true"])
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(str(tmp_path), RUN)
    pub = store.publish(0, hf_state(model), hf_config(model))
    with WeightVersion(pub.path) as wv:
        assert "lm_head.weight" not in wv.tensors and "model.embed_tokens.weight" in wv.tensors
    loaded = AutoModelForCausalLM.from_pretrained(pub.path).eval()
    tokens = torch.tensor([[11, 3, 1, 4, 1, 12, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
