"""`WeightVersion`: a held, read-only view of one published version.

Opening a version takes a shared lock on its manifest, so the store's collector leaves it in place
until `close()` (or the reader's death). Tensors are zero-copy views on the shards in shared memory,
loaded lazily on first access. `verify=True` checks every file's size and sha256 against the manifest
and raises `ChecksumError` on a mismatch, so a bad version is refused and the caller keeps its old one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TYPE_CHECKING

from offpolicy.weights.store import MANIFEST, Manifest, read_manifest, sha256_file


if TYPE_CHECKING:
    import torch


class ChecksumError(ValueError):
    """A file of a weight version does not match its manifest."""


class WeightVersion:
    def __init__(self, path: str | os.PathLike, verify: bool = False):
        self.path = Path(path)
        self._fd = -1
        self._fd = os.open(self.path / MANIFEST, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            if not (self.path / MANIFEST).exists():  # collected between our open and our lock
                raise FileNotFoundError(f"weight version at {self.path} was removed while opening")
            self.manifest: Manifest = read_manifest(self.path)
            if verify:
                self.verify()
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self.version = self.manifest.version
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """HF-named tensors, zero-copy views on the shards (mapped on first access)."""
        if self._tensors is None:
            from offpolicy.weights.safetensors_view import map_tensors  # imports torch

            out: dict[str, torch.Tensor] = {}
            for name in sorted(self.manifest.files):
                if name.endswith(".safetensors"):
                    out.update(map_tensors(self.path / name))
            self._tensors = out
        return self._tensors

    def verify(self) -> None:
        for name, entry in self.manifest.files.items():
            f = self.path / name
            size = f.stat().st_size if f.exists() else -1
            if size != entry.bytes:
                raise ChecksumError(f"{f}: {size} bytes, manifest says {entry.bytes}")
            if entry.sha256 and sha256_file(f) != entry.sha256:
                raise ChecksumError(f"{f}: sha256 differs from the manifest")

    def close(self) -> None:
        """Release the hold; the collector may then remove the files. Tensors already taken from
        `tensors` stay valid (their pages stay mapped); read `tensors` before closing. Not so when the
        writer runs with `weights.reuse_files` (the default for a learner on a GPU): it then writes later
        versions into these very files, and the tensors would show their bytes. Copy what you keep
        before closing (the rollout engines, the relay and the evaluator do)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WeightVersion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightVersion(version={self.version}, path={str(self.path)!r})"
