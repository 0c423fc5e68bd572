"""Versioned weights in shared host memory: the store (writer), `WeightVersion` and `subscribe` (readers);
beside them the model whose weights they are: `models` (HF model construction, seeded initial weights)
and `gguf_import` (a GGUF model file to an HF checkpoint directory).

May import: config, plumbing (docs/architecture.md, "Dependency rule").
"""

from offpolicy.weights.store import Manifest, Published, WeightStore, list_versions, version_dir
from offpolicy.weights.subscribe import subscribe
from offpolicy.weights.version import ChecksumError, WeightVersion

__all__ = ["ChecksumError", "Manifest", "Published", "WeightStore", "WeightVersion", "list_versions",
           "subscribe", "version_dir"]
