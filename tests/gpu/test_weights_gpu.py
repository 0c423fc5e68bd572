"""Weight publish and load with the tensors on a real GPU (skipped without one): the staged path
through pinned buffers, with the shards' sha256 computed by the writer threads from the pinned
buffers they just wrote (tests/unit/test_weights_transfer.py covers the same with host tensors)."""

import pytest
import torch

from offpolicy.weights import WeightStore, WeightVersion, transfer
from offpolicy.weights.store import read_manifest, sha256_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_tensors(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {f"model.layers.{i}.w": torch.randn(1024, 1536, generator=g, device="cuda").to(torch.bfloat16)
           for i in range(6)}
    out["model.norm.weight"] = torch.randn(1024, generator=g, device="cuda")
    out["model.ids"] = torch.arange(5000, device="cuda")
    out["model.host.weight"] = torch.randn(777, generator=g, device="cuda").cpu()  # a host tensor among GPU ones
    return out


@pytest.mark.parametrize("checksum", ["sha256", "none"])
@pytest.mark.parametrize("reuse", [False, True])
def test_gpu_publish_writes_the_bytes_and_checksums(tmp_path, monkeypatch, checksum, reuse):
    monkeypatch.setattr(transfer, "CHUNK", 1 << 20)  # several chunks (and both slots) per tensor
    store = WeightStore(str(tmp_path), "r", keep=2, shard_bytes=4 << 20, checksum=checksum, reuse_files=reuse)
    for v in range(4):  # with reuse, versions 3+ are written into the files of collected ones
        t = gpu_tensors(seed=v)
        store.publish(v, t.items(), {})
        for name, entry in read_manifest(store.dir / f"v{v}").files.items():
            assert entry.sha256 == (sha256_file(store.dir / f"v{v}" / name) if checksum == "sha256" else ""), name
        with WeightVersion(store.dir / f"v{v}") as wv:
            for name, x in t.items():
                assert torch.equal(wv.tensors[name], x.cpu()), name


def test_gpu_load_fills_the_gpu_tensors(tmp_path):
    store = WeightStore(str(tmp_path), "r", shard_bytes=4 << 20)
    t = {k: v.cuda() for k, v in gpu_tensors().items()}
    store.publish(0, t.items(), {})
    for _ in range(2):  # the second load reuses the pinned slots
        dest = {k: torch.zeros_like(v) for k, v in t.items()}
        with WeightVersion(store.dir / "v0") as wv:
            transfer.load_version(dest, wv.path)
        for name, x in t.items():
            assert torch.equal(dest[name], x), name
