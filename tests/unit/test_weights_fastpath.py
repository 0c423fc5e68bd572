"""weights.fastpath.resolve: `auto` write settings become the fast path on a GPU and stay the cautious
path on the CPU; explicit values always win; a reader that verifies keeps its checksums."""

from __future__ import annotations

import pytest

from offpolicy.config import ConfigError, WeightsConfig, load_config
from offpolicy.weights.fastpath import resolve


@pytest.mark.parametrize("fields, gpu, reuse, checksum", [
    ({}, True, True, "none"),                                   # the default on a GPU: recycled, page-locked, unhashed
    ({}, False, False, "sha256"),                               # the default on the CPU: as before
    ({"verify": True}, True, True, "sha256"),                   # a verifying rollout gets its hashes
    ({"reuse_files": False}, True, False, "none"),               # the cautious path, a knob away
    ({"checksum": "sha256"}, True, True, "sha256"),
    ({"reuse_files": True, "checksum": "none"}, False, True, "none"),  # explicit values win on the CPU too
])
def test_auto_resolves_to_the_fast_path_on_a_gpu_only(fields, gpu, reuse, checksum):
    w = resolve(WeightsConfig(**fields), gpu)
    assert (w.reuse_files, w.checksum) == (reuse, checksum)
    assert w.register_maps is True and w.keep == WeightsConfig().keep  # the rest untouched


def test_defaults_are_auto_and_a_verifying_reader_cannot_go_without_checksums():
    base = ["model.arch.model_type=llama"]
    w = load_config(None, base).weights
    assert (w.reuse_files, w.checksum, w.register_maps, w.verify) == ("auto", "auto", True, False)
    assert load_config(None, [*base, "weights.verify=true"]).weights.checksum == "auto"
    with pytest.raises(ConfigError, match="config field weights.verify: needs checksums"):
        load_config(None, [*base, "weights.verify=true", "weights.checksum=none"])
