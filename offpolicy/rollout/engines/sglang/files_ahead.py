"""The files' half of the in-process SGLang engine's proof, computed ahead of the load (`rollout.double_buffer`).

The fingerprint proof (`fingerprint_proof.py`) compares the model SGLang's workers hold after a load with the version's
files. Hashing the files is most of it where the workers read them at the load (docs/sglang.md, "Staged loads"). With
`rollout.double_buffer` the daemon hashes each version's files itself, as the workers would
(`FingerprintProof.files_hash`, the cast their baseline reported), in a thread on its own CUDA stream on the engine's
first GPU (`background.Background`) while the engine still generates with the version before; the load's proof then asks
the workers for the model's half only. With `rollout.sglang.prefetch: device` the staging hashes the tensors it read
instead (`staged.StagedLoads`), with `direct` the load hashes the windows it reads (`staged.WindowsHash`: a hash ahead
read the files a second time beside the load, which waited for it: docs/sglang.md, "The proof's files hashed ahead");
this serves `disk`. Invariants:
- the files hashed are the version's files at its path, read by safetensors (as the workers read them), never the
  engine's tensors: a wrong load still fails the proof;
- a hash that failed or is not there (no baseline yet, the read-back proof, a newer version asked for meanwhile) is
  never waited for in vain: the load's proof then has the workers hash the files, as without it;
- one hash at a time, the newest version asked for (a newer `prefetch` waits for none: the older one's result is left).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from offpolicy.rollout.engines.background import Background, Done
from offpolicy.rollout.engines.fingerprint import checkpoint_tensors
from offpolicy.rollout.engines.sglang.fingerprint_proof import FingerprintProof

log = logging.getLogger("offpolicy.sglang")


class FilesAhead:
    """Each version's files hashed in the background for the proof of its load (the module docstring)."""

    def __init__(self, proof: Callable[[], FingerprintProof | None], device: torch.device):
        self.proof, self.device = proof, device  # proof: the engine's, once it started
        self._ahead: Background | None = None
        self._lock = threading.Lock()
        self.failed: str | None = None  # the last reason a hash ahead failed, said once each

    def prefetch(self, path: str) -> None:
        """Start hashing the files of the version at `path` (returns at once); nothing where the engine's proof has no
        fingerprint baseline to hash for (SGLang's read-back proof, or before the start)."""
        proof = self.proof()
        if proof is None or proof.cast is None or proof.offset is None:
            return
        with self._lock:
            if self._ahead is None or self._ahead.key != path:
                self._ahead = Background(path, lambda: self._hash(path), self.device)

    def _hash(self, path: str) -> dict[str, int] | None:
        proof = self.proof()
        return None if proof is None else proof.files_hash(checkpoint_tensors(path, str(self.device)))

    def take(self, path: str) -> tuple[dict[str, int] | None, Done | None]:
        """The files of `path` hashed ahead, waited for if the hash still runs, and its outcome; (None, None) where no
        hash of them was asked for or it failed (said once per reason)."""
        with self._lock:
            ahead = self._ahead
        try:
            done = ahead.result(path) if ahead is not None else None
        except Exception as e:  # noqa: BLE001 - any: the workers hash the files at the load instead
            why = f"{type(e).__name__}: {e}"
            if why != self.failed:
                log.warning("hashing %s ahead of its load failed (%s); SGLang's workers hash its files at the load",
                            path, why)
                self.failed = why
            return None, None
        if done is None or done.value is None:
            return None, None
        return done.value, done
