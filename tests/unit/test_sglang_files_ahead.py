"""offpolicy/rollout/engines/sglang/files_ahead.py on its own (the engine's loads with it:
tests/unit/test_sglang_standin_model.py): no hash is started where the proof has no fingerprint baseline."""

import types

import torch

from offpolicy.rollout.engines.sglang.files_ahead import FilesAhead


def test_nothing_is_hashed_ahead_without_a_fingerprint_baseline():
    for proof in (None, types.SimpleNamespace(cast=None, offset=None)):  # before the start; the read-back proof
        ahead = FilesAhead(lambda: proof, torch.device("cpu"))
        ahead.prefetch("/nowhere/v1")
        assert ahead._ahead is None and ahead.take("/nowhere/v1") == (None, None)
