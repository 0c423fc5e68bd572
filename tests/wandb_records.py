"""Reads a wandb run file (`run-<id>.wandb` of an offline run) into wandb's own protobuf `Record`s.

wandb 0.31 ships no Python reader for its transaction log (its Go core writes and syncs it), so this
reads the file's framing: a 7-byte header (":W&B", 0xBEE1 little-endian, version 0) then LevelDB log
blocks of 32 KiB, each record framed as crc32 (4), length (2, little-endian), type (1: full, 2 first,
3 middle, 4 last); a block tail shorter than a frame header is zero padding. Each payload is parsed
with `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK, FRAME = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path} is not a wandb run file"
    pos, out, parts = FRAME, [], []
    while pos + FRAME <= len(data):
        if BLOCK - pos % BLOCK < FRAME:
            pos += BLOCK - pos % BLOCK  # padding at a block's end
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + FRAME])
        body = data[pos + FRAME:pos + FRAME + length]
        if kind == 0 and length == 0:
            break
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += FRAME + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        else:
            out.append(b"".join(parts + [body]))
    return out


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    recs = []
    for body in payloads(path):
        r = pb.Record()
        r.ParseFromString(body)
        recs.append(r)
    return recs


def history(path: str | Path) -> list[dict]:
    """The logged rows of a run file: {"_step": step, key: value, ...} in the order they were logged."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.append({"_step": r.history.step.num, **row})
    return rows


def run_info(path: str | Path) -> dict:
    """The run record's id, project and config keys."""
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            return {"id": r.run.run_id, "project": r.run.project,
                    "config": {u.key: json.loads(u.value_json) for u in r.run.config.update}}
    raise AssertionError(f"{path} has no run record")
