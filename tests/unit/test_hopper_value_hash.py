"""offpolicy/rollout/engines/hopper_value_hash.py: MXFP4 expert values held in triton_kernels' Hopper value layout hash
like the checkpoint's bytes without an unswizzle, against a layout written from the format (tests/kernel_wrappers.py);
the Triton kernel's half: tests/unit/test_fingerprint_triton.py."""

from __future__ import annotations

import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines import hopper_value_hash as hv
from tests.kernel_wrappers import HopperValueLayout, Storage, ValueLayout, hopper_pack, hopper_unpack


def blocks(seed: int, shape=(3, 20, 12)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    b[0, ::3] = 0  # zero bytes count nothing, as the padding's
    return b


def test_unpacked_inverts_the_layouts_bit_format():
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, 256, (1000, 4), dtype=torch.uint8, generator=g)
    b[::7] = 0
    b[1::5] = 0xFF
    assert torch.equal(hv.unpacked(hopper_pack(b)), b)
    assert torch.equal(hopper_unpack(hopper_pack(b)), b)  # the stand-in's own inverse agrees
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (500,), dtype=torch.int32, generator=g)
    assert torch.equal(hopper_pack(hv.unpacked(words)), words)  # every 32-bit word: a bijection


def test_held_words_unpack_to_bytes_that_hash_like_the_checkpoint_in_either_orientation():
    b = blocks(1)
    want = fp.tensor_fingerprint(b)
    for transposed in (False, True):
        layout = HopperValueLayout(b.shape, transposed)
        held = Storage(layout.swizzle_data(b), layout)
        assert torch.equal(layout.unswizzle_data(held.data), b)
        assert fp.tensor_fingerprint(held.data) != want  # the bits moved across bytes: the raw bytes hash otherwise
        words = hv.held_words(held, held.data)
        assert words is not None and words.numel() == held.data.numel() // 4
        assert hv.torch_fingerprint(words, fp.tensor_fingerprint) == want
        assert hv.fingerprint(words, fp.tensor_fingerprint) is None  # no kernel here (its test runs the interpreter)
        assert fp.held_fingerprint(held, held.data) == want  # so the unswizzle serves
    changed = b.clone()
    changed[2, 5, 7] ^= 0x10  # one fp4 value of one byte
    layout = HopperValueLayout(b.shape)
    words = hv.held_words(Storage(None, layout), layout.swizzle_data(changed))
    assert hv.torch_fingerprint(words, fp.tensor_fingerprint) != want


def test_other_layouts_and_storage_that_is_not_one_block_take_the_unswizzle():
    b = blocks(2)
    other = ValueLayout()  # another layout (no Hopper name): unswizzled, a few experts a call
    held = Storage(other.swizzle_data(b), other)
    assert hv.held_words(held, held.data) is None
    assert fp.held_fingerprint(held, held.data) == fp.tensor_fingerprint(b)
    layout = HopperValueLayout((3, 20, 24))
    wide = layout.swizzle_data(blocks(3, (3, 20, 24)))
    part = wide[:, ::2]  # neither orientation contiguous
    assert hv.held_words(Storage(part, layout), part) is None
    assert hv.held_words(Storage(wide.float(), layout), wide.float()) is None  # not the layout's bytes
    assert hv.held_words(object(), wide) is None


def test_the_torch_path_hashes_in_chunks_alike(monkeypatch):
    b = blocks(4, (4, 64, 40))
    layout = HopperValueLayout(b.shape)
    words = hv.held_words(Storage(layout.swizzle_data(b), layout), layout.swizzle_data(b))
    monkeypatch.setattr(hv, "CHUNK", 7)
    assert hv.torch_fingerprint(words, fp.tensor_fingerprint) == fp.tensor_fingerprint(b)
