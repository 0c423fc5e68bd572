"""Versioned weights in shared host memory: the store (writer), `WeightVersion` and `subscribe` (readers).

Modules: `store` (`WeightStore`: versions renamed into place, kept, freed), `publisher` (`Publisher`: one
version in every configured format, from the backend's tensors or its ranks' own shards), `sharded` and
`parts` (a version written by several processes), `formats`, `fp8`, `mxfp4` and `triton_quant` (the low-bit
formats and their kernels), `lowbit_load` (a low-bit version read into a model, dequantized), `layout`, `maps`, `safetensors_view`, `transfer` and `fastpath` (the
write and read paths), `version` (`WeightVersion`), `subscribe` (the public API), `profile`, `config_json`
(fields a version's config.json spells out for servers on other transformers versions).

May import: config, plumbing, wire (docs/architecture.md, "Dependency rule").
"""

from offpolicy.weights.store import Manifest, Published, WeightStore, list_versions, version_dir
from offpolicy.weights.subscribe import subscribe
from offpolicy.weights.version import ChecksumError, WeightVersion

__all__ = ["ChecksumError", "Manifest", "Published", "WeightStore", "WeightVersion", "list_versions",
           "subscribe", "version_dir"]
