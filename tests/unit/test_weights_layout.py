"""The file layout of a sharded version (weights/layout.py): pure planning, no torch, no processes."""

import json
import struct

import pytest

from offpolicy.weights.layout import LayoutError, Piece, plan


def _pieces():
    return [
        Piece("embed", "BF16", (10, 4), -1, (0, 0, 0), rank=0),
        Piece("norm", "F32", (4,), -1, (0, 1, 0), rank=1),
        Piece("experts", "BF16", (2, 3, 4), 0, (0, 2, 0), rank=0),  # rows 0-1 of a fused [4, 3, 4]
        Piece("experts", "BF16", (2, 3, 4), 2, (0, 3, 0), rank=1),  # rows 2-3
        Piece("head", "BF16", (10, 4), -1, (1, 0, 0), rank=1),
    ]


def test_sharded_publish_layout_puts_each_writer_set_in_its_own_files_at_consistent_offsets():
    lay = plan(_pieces(), shard_bytes=1 << 30)
    assert [f.writers for f in lay.files] == [(0,), (1,), (0, 1)]  # files in the order of their first tensor
    assert [f.tensors for f in lay.files] == [("embed",), ("norm", "head"), ("experts",)]
    assert lay.specs["experts"] == ("BF16", (4, 3, 4)) and lay.num_tensors == 4
    assert lay.total_bytes == 80 + 16 + 96 + 80
    f = lay.files[2]
    (n,) = struct.unpack("<Q", f.header[:8])
    header = json.loads(f.header[8:8 + n])
    assert header["experts"] == {"dtype": "BF16", "shape": [4, 3, 4], "data_offsets": [0, 96]}
    assert len(f.header) % 8 == 0 and f.size == len(f.header) + 96
    assert lay.where[("experts", 0)] == (2, len(f.header)) and lay.where[("experts", 2)] == (2, len(f.header) + 48)
    assert lay.where[("head", -1)] == (1, len(lay.files[1].header) + 16)
    assert lay.index()["weight_map"] == {"embed": lay.files[0].name, "norm": lay.files[1].name,
                                         "head": lay.files[1].name, "experts": lay.files[2].name}
    assert lay.files[0].name == "model-00001-of-00003.safetensors"
    assert lay.files_of(1) == [1, 2]


def test_sharded_publish_layout_is_the_same_whatever_order_the_pieces_come_in():
    assert plan(_pieces(), 1 << 30) == plan(list(reversed(_pieces())), 1 << 30)


def test_sharded_publish_layout_cuts_a_writers_share_into_files_of_at_most_the_limit():
    big = [Piece(f"t{i}", "U8", (100 << 20,), -1, (i,), rank=0) for i in range(5)]
    lay = plan(big, shard_bytes=250 << 20)
    assert [len(f.tensors) for f in lay.files] == [2, 2, 1]
    lay = plan(big, shard_bytes=1 << 40, threads=5)  # spread over threads: 128 MiB files at least
    assert [len(f.tensors) for f in lay.files] == [1, 1, 1, 1, 1]


@pytest.mark.parametrize("pieces, match", [
    ([Piece("x", "BF16", (2, 4), 0, (0,), rank=0), Piece("x", "BF16", (2, 4), 3, (1,), rank=1)], "missing or doubled"),
    ([Piece("x", "BF16", (2, 4), 0, (0,), rank=0), Piece("x", "F32", (2, 4), 2, (1,), rank=1)], "disagree"),
    ([Piece("x", "BF16", (2,), -1, (0,), rank=0), Piece("x", "BF16", (2,), -1, (0,), rank=1)], "written whole"),
    ([Piece("x", "BF16", (2, 4), 0, (0,), rank=0, node=0), Piece("x", "BF16", (2, 4), 2, (1,), rank=1, node=1)],
     "one node"),
])
def test_sharded_publish_layout_refuses_pieces_that_make_no_checkpoint(pieces, match):
    with pytest.raises(LayoutError, match=match):
        plan(pieces, 1 << 30)
