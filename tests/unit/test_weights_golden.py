"""The published bytes stay the same: a fixed set of tensors, published by the one-process store
(`WeightStore.publish`) and by one rank of the sharded publish (`ShardWriter`, staged and through host maps of
recycled files), gives shard files and an index whose sha256 are pinned here. A change to the write path
(issue 48's publish work) that alters a byte of a version fails this test."""

from __future__ import annotations

import hashlib

import pytest
import torch

from offpolicy.config import WeightsConfig
from offpolicy.weights import WeightStore, transfer
from offpolicy.weights.store import INDEX, version_dir

# sha256 of each file of the version, the same from every path below
GOLDEN = {
    "model-00001-of-00003.safetensors": "2d7e5996f316b17d2c9e8059a92c9ee0ed82ad7753bc089659b89013d256e892",
    "model-00002-of-00003.safetensors": "4c11dc702463daf41784c7988cbe95145ed0803b624d55c4c7bc3158c52f8598",
    "model-00003-of-00003.safetensors": "f0aa682ebab3fa00f237d79252c4dc202b993645c34a3e626961a41cdddeef22",
    INDEX: "f56a04c464958fdf69756018177f61743fb05895e344acd35046ba3a1ecb4421",
}


def _bits(n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """n values of `dtype` with fixed bit patterns (integer arithmetic: the same on every build)."""
    width = torch.tensor([], dtype=dtype).element_size()
    raw = (torch.arange(n * width, dtype=torch.int64) * 2654435761 + salt) % 251
    return raw.to(torch.uint8).view(dtype)


def tensors() -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed_tokens.weight", _bits(300 * 64, torch.bfloat16, 1).view(300, 64)),
        ("model.layers.0.self_attn.q_proj.weight", _bits(64 * 64, torch.bfloat16, 2).view(64, 64)),
        ("model.layers.0.input_layernorm.weight", _bits(64, torch.float32, 3)),
        ("model.layers.0.mlp.experts.gate_up_proj", _bits(4 * 64 * 96, torch.bfloat16, 4).view(4, 64, 96)),
        ("model.layers.0.ids", _bits(100, torch.int64, 5)),
        ("model.empty", torch.empty(0, 4)),
        ("lm_head.weight", _bits(300 * 64, torch.bfloat16, 6).view(300, 64)),
    ]


HF = {"model_type": "llama"}
SHARD = 64 << 10  # three shards


def _digests(path) -> dict[str, str]:
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in GOLDEN}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK", 4096)


@pytest.mark.parametrize("checksum", ["sha256", "none"])
def test_the_store_publishes_the_pinned_bytes(tmp_path, small_chunks, checksum):
    store = WeightStore(str(tmp_path), "gold", keep=2, shard_bytes=SHARD, checksum=checksum)
    store.publish(0, tensors(), HF)
    assert _digests(version_dir(tmp_path, "gold", 0)) == GOLDEN


@pytest.mark.parametrize("maps", [False, True], ids=["staged", "maps"])
def test_one_rank_of_the_sharded_publish_writes_the_pinned_bytes(tmp_path, small_chunks, maps):
    from offpolicy.weights.maps import MapCache
    from offpolicy.weights.sharded import ShardWriter

    w = WeightsConfig(root=str(tmp_path), keep=1, shard_bytes=SHARD, checksum="none", reuse_files=True,
                      register_maps=maps)
    writer = ShardWriter(w, "gold", rank=0, world=1)
    if maps:  # host maps (no GPU here): recycled files met again are written through their maps
        writer.maps = MapCache(4, register=lambda *a: None, unregister=lambda *a: None, host=True)
    pieces = [(name, None, t, (i,)) for i, (name, t) in enumerate(tensors())]
    for v in range(6):  # the later versions go into recycled files (through their maps with `maps`)
        got = writer.begin(v, ["native"], pieces, HF).wait()
        assert _digests(version_dir(tmp_path, "gold", v)) == GOLDEN, v
    assert got["native"].total_bytes == sum(t.numel() * t.element_size() for _, t in tensors())
    if maps:
        assert writer.maps.registered > 0
