"""`offpolicy stores` underneath: listing stores with their owner, freeing only those nobody owns."""

from __future__ import annotations

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.plumbing import runlock, stores
from offpolicy.weights import WeightStore
from tests.conftest import QUICKSTART


def publish(root: str, run: str, versions) -> None:
    store = WeightStore(root, run, keep=5)
    for v in versions:
        store.publish(v, [("w", torch.full((256,), float(v)))], {"model_type": "llama"})


def test_list_and_free(shm_root):
    publish(shm_root, "a", [0, 1, 2])
    publish(shm_root, "a/fp8", [2])
    publish(shm_root, "b", [5])
    found = {s.name: s for s in stores.list_stores(shm_root)}
    assert sorted(found) == ["a", "b"]
    assert found["a"].versions == [0, 1, 2] and found["a"].formats == ["fp8"] and found["a"].owner is None
    assert found["a"].bytes > 4 * 1024 and "can be freed" in stores.table(list(found.values()))
    assert stores.free(shm_root, "a") == found["a"].bytes
    assert [s.name for s in stores.list_stores(shm_root)] == ["b"]
    with pytest.raises(FileNotFoundError):
        stores.free(shm_root, "a")
    with pytest.raises(FileNotFoundError):
        stores.free(shm_root, "../etc")


def test_a_live_store_is_never_freed(shm_root, tmp_path):
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", f"weights.root={shm_root}"])
    publish(shm_root, "quickstart", [0])
    lock = runlock.acquire(cfg)
    try:
        (live,) = stores.list_stores(shm_root)
        assert live.owner is not None and "live: pid" in stores.table([live])
        with pytest.raises(stores.StoreLive, match="is live"):
            stores.free(shm_root, "quickstart")
        assert stores.list_stores(shm_root)[0].versions == [0]
    finally:
        lock.release()
    stores.free(shm_root, "quickstart")
    assert stores.list_stores(shm_root) == []
    runlock.acquire(cfg).release()  # the lock file unlinked by free: a new learner locks a fresh one
