"""A version written from several learner nodes, put together from its parts.

A learner on several nodes commits, on each node, that node's files of a version with the whole
manifest (each file's `node`) as `<format's store>/node<k>/v<N>` (weights/sharded.py): no node holds the
version whole, so no reader there can take a part for a version. `assemble(parts, dest)` copies every
file from the part of the node that holds it (`parts[k]` = node k's part directory), manifest last,
into a hidden sibling of `dest` and renames it into place: `dest` appears complete or not at all.
Pure file handling, no torch (the relay may use it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from offpolicy.weights.store import MANIFEST, read_manifest, write_private


def assemble(parts: list[str | os.PathLike], dest: str | os.PathLike) -> None:
    parts, dest = [Path(p) for p in parts], Path(dest)
    raw = (parts[0] / MANIFEST).read_bytes()
    manifest = read_manifest(parts[0])
    if manifest.nodes != len(parts):
        raise ValueError(f"version {manifest.version} was written from {manifest.nodes} nodes, {len(parts)} parts given")
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    tmp.mkdir(mode=0o700)
    try:
        for name, entry in manifest.files.items():
            src = parts[entry.node] / name
            if src.stat().st_size != entry.bytes:
                raise ValueError(f"{src}: {src.stat().st_size} bytes, the manifest says {entry.bytes}")
            shutil.copyfile(src, tmp / name)
        write_private(tmp / MANIFEST, raw)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
