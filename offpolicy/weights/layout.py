"""The file layout of a version that several processes write: which tensor lies in which shard file, where.

A `Piece` is what one learner rank writes of one checkpoint tensor: the whole tensor, or rows
`row .. row + shape[0]` of its first dimension (safetensors is row-major, so those rows are one contiguous
byte range; GPT-OSS's fused expert tensors are written so, each expert-parallel rank its experts' rows).
`plan(pieces, ...)` is a pure function of every rank's pieces (names, dtypes, shapes, rows, order keys,
writers), so every rank that holds the same list computes the same `Layout`:

- tensors keep the checkpoint's order (`Piece.order`, the position in today's gathered stream);
- a file holds tensors of one set of writers on one node, so a file written by one rank is hashed by
  that rank as it writes it, and no file spans two nodes (each node's ranks write into their own store);
- each writer set's tensors are cut into files of at most `limit` bytes (a larger tensor gets a file of
  its own), `limit = min(shard_bytes, max(PARALLEL_SHARD_BYTES, bytes / threads))` as the one-process
  store cuts them, so one writer's share spreads over its threads;
- files are named `model-<i>-of-<n>.safetensors` in the order of their first tensor; each file's
  header (8-byte length, JSON, padded to 8 bytes as safetensors writes it) is fixed by the plan, and
  `where[(name, row)]` gives each piece's absolute offset in its file.

Invariant: the files, filled with the pieces at their offsets, are a standard sharded safetensors
checkpoint (`index()` is its `model.safetensors.index.json` weight map) with exactly the pieces' tensors.
Pure and light: no torch.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

import msgspec

PARALLEL_SHARD_BYTES = 128 << 20  # as weights/store.py: the smallest shard cut to spread writing over threads
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}


class Piece(msgspec.Struct, frozen=True, array_like=True):
    name: str  # checkpoint tensor name
    dtype: str  # safetensors dtype name (BF16, F32, F8_E4M3, U8, ...)
    shape: tuple[int, ...]  # this piece's shape: the whole tensor's, or (its rows, *the tensor's other dims)
    row: int  # -1: the whole tensor; else the first row (of the first dimension) of the tensor it holds
    order: tuple[int, ...]  # the tensor's place in the checkpoint (pieces of one tensor: the smallest counts)
    rank: int  # global rank that writes it
    node: int = 0  # the writer's node (index into the learner's nodes)

    @property
    def row_bytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


class FilePlan(msgspec.Struct, frozen=True):
    name: str  # model-<i>-of-<n>.safetensors
    node: int  # the node whose store holds it
    writers: tuple[int, ...]  # ranks writing into it, sorted
    header: bytes  # the safetensors prefix: length, JSON header, padding
    size: int  # bytes of the whole file
    tensors: tuple[str, ...]  # tensor names in file order

    @property
    def data_bytes(self) -> int:
        return self.size - len(self.header)


class Layout(msgspec.Struct, frozen=True):
    files: tuple[FilePlan, ...]
    where: dict[tuple[str, int], tuple[int, int]]  # (tensor, Piece.row) -> (file index, absolute offset)
    specs: dict[str, tuple[str, tuple[int, ...]]]  # tensor -> (safetensors dtype, whole shape)
    total_bytes: int  # tensor bytes over all files

    @property
    def num_tensors(self) -> int:
        return len(self.specs)

    def index(self) -> dict:
        """The `model.safetensors.index.json` content."""
        return {"metadata": {"total_size": self.total_bytes},
                "weight_map": {t: f.name for f in self.files for t in f.tensors}}

    def files_of(self, rank: int) -> list[int]:
        """Indices of the files `rank` writes into."""
        return [i for i, f in enumerate(self.files) if rank in f.writers]


class LayoutError(ValueError):
    """The pieces do not make a checkpoint (a tensor's rows missing or doubled, shapes that disagree)."""


def plan(pieces: Iterable[Piece], shard_bytes: int, threads: int = 1) -> Layout:
    """The layout of a version made of `pieces` (every rank's); see the module doc."""
    by_name: dict[str, list[Piece]] = {}
    for p in pieces:
        by_name.setdefault(p.name, []).append(p)
    tensors = []  # (order, name, dtype, shape, nbytes, node, writers)
    for name, ps in by_name.items():
        ps.sort(key=lambda p: p.row)
        first = ps[0]
        if first.row < 0:
            if len(ps) > 1:
                raise LayoutError(f"tensor {name}: written whole by ranks {sorted(p.rank for p in ps)}")
            shape = tuple(first.shape)
        else:
            at = 0
            for p in ps:
                if (p.dtype, tuple(p.shape[1:])) != (first.dtype, tuple(first.shape[1:])) or not p.shape:
                    raise LayoutError(f"tensor {name}: pieces disagree on dtype/shape ({p.dtype} {list(p.shape)} vs "
                                      f"{first.dtype} {list(first.shape)})")
                if p.row != at:
                    raise LayoutError(f"tensor {name}: rows {at}.. are missing or doubled (a piece starts at {p.row})")
                at += p.shape[0]
            shape = (at, *first.shape[1:])
        nodes = {p.node for p in ps}
        if len(nodes) > 1:
            raise LayoutError(f"tensor {name}: written from nodes {sorted(nodes)}; a tensor's pieces must come "
                              "from one node (place the expert-parallel ranks of a layer on one node)")
        tensors.append((min(p.order for p in ps), name, first.dtype, shape, sum(p.nbytes for p in ps), first.node,
                        tuple(sorted({p.rank for p in ps}))))
    tensors.sort()
    groups: dict[tuple[int, tuple[int, ...]], list] = {}
    for t in tensors:
        groups.setdefault((t[5], t[6]), []).append(t)
    cut = []  # (first order, node, writers, [tensors]) per file
    for (node, writers), ts in groups.items():
        total = sum(t[4] for t in ts)
        limit = min(shard_bytes, max(PARALLEL_SHARD_BYTES, -(-total // max(1, threads))))
        files, size = [[]], 0
        for t in ts:
            if files[-1] and size + t[4] > limit:
                files.append([])
                size = 0
            files[-1].append(t)
            size += t[4]
        cut += [(f[0][0], node, writers, f) for f in files]
    cut.sort(key=lambda c: c[0])
    out, where = [], {}
    for i, (_, node, writers, ts) in enumerate(cut):
        header, offsets = _header([(t[1], t[2], t[3], t[4]) for t in ts])
        for t, begin in zip(ts, offsets):
            for p in by_name[t[1]]:
                where[(p.name, p.row)] = (i, len(header) + begin + max(p.row, 0) * p.row_bytes)
        size = len(header) + sum(t[4] for t in ts)
        out.append(FilePlan(name=f"model-{i + 1:05d}-of-{len(cut):05d}.safetensors", node=node, writers=writers,
                            header=header, size=size, tensors=tuple(t[1] for t in ts)))
    return Layout(files=tuple(out), where=where, specs={t[1]: (t[2], t[3]) for t in tensors},
                  total_bytes=sum(t[4] for t in tensors))


def _header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[int]]:
    """The safetensors prefix of (name, dtype, shape, nbytes) in order, and each tensor's data offset."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, pos = [], 0
    for name, dtype, shape, n in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets
