"""The in-process SGLang engine's fingerprint proof against the stand-in `sglang` whose scheduler holds a real model
(tests/sglang_inprocess.py, plan `model`): transformers' Llama in HF names, loaded from the checkpoint the engine starts
on, each version's files loaded into it, offpolicy's fingerprint loader (`sglang/worker.py`) run on it in the scheduler
process. A load is proven; a load the scheduler says it did but did not is caught. The daemons' run:
tests/integration/test_sglang_fingerprint_rehearsal.py."""

from __future__ import annotations

import json
import os

import pytest

import tests.sglang_inprocess as standin
from offpolicy.config import load_config
from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.sglang.local import LocalBackend
from offpolicy.rollout.engines.sglang.mxfp4_inplace import LOADER as MXFP4_LOADER
from offpolicy.rollout.engines.sglang.worker import LOADER, SYNCED_LOADER, request
from tests.conftest import QUICKSTART


@pytest.fixture
def standin_model(monkeypatch, tmp_path):
    """The stand-in installed, its scheduler holding a model; its SIGQUIT handler records instead of killing pytest."""
    with standin.installed(monkeypatch):
        monkeypatch.setenv(standin.ENV, json.dumps({"dir": str(tmp_path), "model": True, "skip_update_at": 3}))
        yield


def test_a_real_model_in_the_stand_in_scheduler_proves_each_load_and_catches_one_that_did_not_happen(standin_model,
                                                                                                    published):
    v0, v1, v2 = published("r", [], versions=3, moved=True)["native"]
    cfg = load_config(QUICKSTART, [f"model.path={v0}", "rollout.engine=sglang", "rollout.sglang.mode=engine",
                                   "rollout.sglang.proof=fingerprint"])
    b = LocalBackend(cfg, seed=0)  # the baseline: the model transformers loaded from v0, against v0's files
    try:
        assert b.fingerprint is not None and b.fingerprint.offset is not None, b.fingerprint.why
        assert b.engine.update_weights_from_tensor([(request("/nowhere", None), None)], load_format="direct") == (
            False, f"the stand-in scheduler runs no custom weight loader direct (model held; loaders "
                   f"{[LOADER, SYNCED_LOADER, MXFP4_LOADER]})")
        b.update_weights(v0, 0)
        b.update_weights(v1, 1)
        assert [s["verified"] for s in b.swaps] == [True, True], b.swaps
        assert "model.layers.0.self_attn" in b.swaps[1]["changed"] and len(b.swaps[1]["groups"]) == 12
        with pytest.raises(WeightUpdateError, match=r"model\.layers\.0\.self_attn \(it still holds version 1's"):
            b.update_weights(v2, 2)  # the scheduler's third load loads nothing (skip_update_at)
        assert b.version is None
    finally:
        b.close()
    assert standin.SIGQUITS_TAKEN == []


def test_versions_staged_ahead_load_from_tensors_and_are_proven(standin_model, published):
    """rollout.sglang.prefetch=device (staged.py): each version read by offpolicy's reader into the engine's arena (on
    the CPU here), ahead (as the prefetcher asks) or at the load, and handed to update_weights_from_tensor; the proof
    is the same as from disk, and a load the scheduler skipped is caught."""
    v0, v1, v2 = published("r", [], versions=3, moved=True)["native"]
    cfg = load_config(QUICKSTART, [f"model.path={v0}", "rollout.engine=sglang", "rollout.sglang.mode=engine",
                                   "rollout.sglang.proof=fingerprint", "rollout.sglang.prefetch=device"])
    b = LocalBackend(cfg, seed=0)
    try:
        assert b.staged is not None and b.staged.device.type == "cpu"
        b.update_weights(v0, 0)  # staged at the load: nothing asked ahead
        b.staged.prefetch(v1)  # ahead, as the prefetcher asks when the daemon hears of version 1
        b.update_weights(v1, 1)
        assert [(s["method"], s["verified"]) for s in b.swaps] == [("device", True), ("device", True)], b.swaps
        assert not b.swaps[0]["staged"]["ahead"] and "prefetch" not in b.swaps[0]
        assert b.swaps[1]["staged"]["ahead"] and b.swaps[1]["prefetch"]["seconds"] > 0, b.swaps[1]
        assert b.swaps[1]["staged"]["bytes"] > 0 and "model.layers.0.self_attn" in b.swaps[1]["changed"]
        assert all(s["seconds"] >= s["load"] > 0 for s in b.swaps)  # SGLang's update call, timed within the swap
        from offpolicy.rollout.engines.sglang.engine import _parts
        assert _parts(b.swaps[0]).startswith(" (SGLang's update ") and _parts(b.swaps[0]).endswith(" s)")
        assert _parts(b.swaps[1]).endswith(" s for the staging ahead)") and _parts({"seconds": 1.0}) == ""
        assert [s["files_ahead"] for s in b.swaps] == [True, True]  # the staging hashed what it read: the workers
        assert [s["hash_files_seconds"] for s in b.swaps] == [0.0, 0.0]  # hashed only the model
        assert standin.REDUCTIONS_PATCHED  # SGLang's device-UUID reductions, as its Engine does before pickling
        with pytest.raises(WeightUpdateError, match=r"model\.layers\.0\.self_attn \(it still holds version 1's"):
            b.update_weights(v2, 2)  # the scheduler's third load loads nothing (skip_update_at)
    finally:
        b.close()
    assert standin.SIGQUITS_TAKEN == []


def test_direct_loads_hand_each_version_a_window_at_a_time_and_are_proven(standin_model, published, monkeypatch):
    """rollout.sglang.prefetch=direct (staged.direct_requests): nothing staged, each version read at the load a window
    of tensors a request (small windows here: several requests a version), the label set by the last; proven as
    from disk, and a load the scheduler skipped is caught."""
    from offpolicy.rollout.engines.sglang import staged

    monkeypatch.setattr(staged, "DIRECT_WINDOW", 4096)
    v0, v1, v2 = published("r", [], versions=3, moved=True)["native"]
    first_of_v2 = len(staged.window_plan(v0, window=4096)) + len(staged.window_plan(v1, window=4096)) + 1
    monkeypatch.setenv(standin.ENV, json.dumps({**json.loads(os.environ[standin.ENV]), "skip_update_at": first_of_v2}))
    cfg = load_config(QUICKSTART, [f"model.path={v0}", "rollout.engine=sglang", "rollout.sglang.mode=engine",
                                   "rollout.sglang.proof=fingerprint", "rollout.sglang.prefetch=direct"])
    b = LocalBackend(cfg, seed=0)
    try:
        assert b.staged is None  # nothing staged, no arena kept
        b.update_weights(v0, 0)
        b.update_weights(v1, 1)
        assert [(s["method"], s["verified"], s.get("direct")) for s in b.swaps] == [("direct", True, True)] * 2
        assert "staged" not in b.swaps[1] and "model.layers.0.self_attn" in b.swaps[1]["changed"]
        assert b.files_ahead is None  # the load hashes what it reads: no second read of the files beside it
        assert [(s["files_ahead"], s["hash_files_seconds"], s["files_hash"]["as_read"]) for s in b.swaps] == [
            (True, 0.0, True)] * 2, b.swaps  # the workers hashed only the model
        assert len(staged.window_plan(v1, window=4096)) > 2 and SYNCED_LOADER in b.loaders  # answers after the copies
        with pytest.raises(WeightUpdateError, match=r"it still holds version 1's"):
            b.update_weights(v2, 2)  # the scheduler skips version 2's first window (skip_update_at)
    finally:
        b.close()
    assert standin.SIGQUITS_TAKEN == []


def test_a_direct_load_whose_window_hash_fails_is_proven_by_the_workers_hashing_the_files(standin_model, published,
                                                                                          monkeypatch, caplog):
    v0, v1 = published("r", [], versions=2, moved=True)["native"]
    cfg = load_config(QUICKSTART, [f"model.path={v0}", "rollout.engine=sglang", "rollout.sglang.mode=engine",
                                   "rollout.sglang.proof=fingerprint", "rollout.sglang.prefetch=direct"])
    b = LocalBackend(cfg, seed=0)
    try:
        monkeypatch.setattr(b.fingerprint, "files_hash", lambda tensors: 1 / 0)
        b.update_weights(v1, 1)
        (r,) = b.swaps
        assert (r["verified"], r["files_ahead"], "files_hash" in r, r["hash_files_seconds"] > 0) == (
            True, False, False, True), r
        assert "hashing a direct load's window failed (ZeroDivisionError" in caplog.text
    finally:
        b.close()


def test_the_files_hashed_ahead_prove_a_load_and_catch_one_that_did_not_happen(standin_model, published, monkeypatch,
                                                                              caplog):
    """rollout.double_buffer (files_ahead.py) with SGLang reading the files (disk): the daemon hashes each version's
    files in the background as the workers would, and the load's proof asks them for the model's half only; a load the scheduler skipped is still caught; a
    version not hashed ahead, or whose hash failed, is proven as before (the workers hash the files)."""
    v0, v1, v2, v3, v4 = published("r", [], versions=5, moved=True)["native"]
    cfg = load_config(QUICKSTART, [f"model.path={v0}", "rollout.engine=sglang", "rollout.sglang.mode=engine",
                                   "rollout.sglang.proof=fingerprint", "rollout.sglang.prefetch=disk"])
    b = LocalBackend(cfg, seed=0)
    try:
        assert b.staged is None and b.files_ahead is not None
        b.files_ahead.prefetch(v1)
        b.update_weights(v1, 1)
        b.update_weights(v2, 2)  # not asked ahead: the workers hash the files
        r1, r2 = b.swaps
        assert (r1["verified"], r1["files_ahead"], r1["hash_files_seconds"]) == (True, True, 0.0), r1
        assert r1["files_hash"]["seconds"] > 0 and "model.layers.0.self_attn" in r1["changed"]
        assert (r2["verified"], r2["files_ahead"], "files_hash" in r2) == (True, False, False)
        assert r2["hash_files_seconds"] > 0
        b.files_ahead.prefetch(v3)
        with pytest.raises(WeightUpdateError, match=r"it still holds version 2's"):
            b.update_weights(v3, 3)  # the scheduler's third update loads nothing (skip_update_at)
        monkeypatch.setattr(b.fingerprint, "files_hash", lambda tensors: 1 / 0)
        b.files_ahead.prefetch(v4)
        b.update_weights(v4, 4)
        assert (b.swaps[-1]["verified"], b.swaps[-1]["files_ahead"], b.version) == (True, False, 4)
        assert "hashing" in caplog.text and "ZeroDivisionError" in caplog.text
        assert "hash its files at the load" in caplog.text
    finally:
        b.close()
    assert standin.SIGQUITS_TAKEN == []


@pytest.mark.parametrize("tensors", [False, True])
def test_a_version_that_does_not_fit_its_staging_loads_direct_where_the_engine_takes_tensors_else_from_disk(
        standin_model, published, monkeypatch, caplog, tensors):
    """rollout.sglang.prefetch=device without room: the load reads the version `direct` where the engine takes
    tensors (`staged.from_tensors`: a GPU, bf16, one replica; stood in for here), else from disk."""
    from offpolicy.rollout.engines import staging
    from offpolicy.rollout.engines.sglang import staged

    monkeypatch.setattr(staged, "from_tensors", lambda cfg: tensors)
    v0, v1 = published("r", [], versions=2, moved=True)["native"]
    cfg = load_config(QUICKSTART, [f"model.path={v0}", "rollout.engine=sglang", "rollout.sglang.mode=engine",
                                   "rollout.sglang.proof=fingerprint", "rollout.sglang.prefetch=device"])
    b = LocalBackend(cfg, seed=0)
    try:
        monkeypatch.setattr(staging, "available_host_bytes", lambda: 100)  # no room for the version
        b.update_weights(v1, 1)
        method = "direct" if tensors else "disk"
        assert [(s["method"], s["verified"]) for s in b.swaps] == [(method, True)] and "staged" not in b.swaps[0]
        assert "rollout.sglang.prefetch=device: staging the version takes" in caplog.text
        assert "use rollout.sglang.prefetch=disk" in caplog.text
        assert ("loads direct (read onto the GPU" if tensors else "loads from disk") in caplog.text
    finally:
        b.close()
