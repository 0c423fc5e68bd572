"""The fingerprint of MXFP4 expert values held in triton_kernels' Hopper value layout, without unswizzling them.

vLLM 0.26 (its vendored triton_kernels) and SGLang 0.5.14 (the triton_kernels package) serve GPT-OSS's MXFP4 experts on
Hopper from kernel wrappers whose storage is in `HopperMXValueLayout` (`layout.name` "HOPPER_VALUE",
`tensor_details/layout_details/hopper_value.py`): the checkpoint's bytes zero-padded, permuted, and the bits of every
four consecutive bytes of the result (one little-endian int32 word of the held memory) interleaved so that the matmul
dequantizes in few instructions (`_pack_bits`). Its `unswizzle_data` undoes that in two steps: each int32 word of the
held memory unpacked into four bytes (`_unpack_bits`, the formula in `unpacked`), then a permutation of bytes and the
padding cut off. A fingerprint is a multiset hash of bytes, blind to their order, in which a zero byte counts nothing
(fingerprint.py): so the unswizzled tensor's fingerprint is that of the held words' unpacked bytes, in any order, the
padding's zeros included. `fingerprint` computes it in one pass over the held memory (one Triton kernel on a GPU,
`fingerprint_triton.hopper_fingerprint`), where `unswizzle_data` ran some twenty torch kernels through int32 temporaries
a few experts at a time: on the 2-layer GPT-OSS slice, several times the bf16 model's whole fingerprint a swap, a
cost that grows with the layers (measured: docs/vllm.md, "Every version is proven, not assumed").

Checked against both engines' own `swizzle_data` / `unswizzle_data` on the CPU (docs/vllm.md),
and in the tests against a layout written from the format (tests/kernel_wrappers.py `HopperValueLayout`). A layout of
another name (another GPU's, a stand-in), storage that is not one contiguous block in either orientation, or an offset
that is not word-aligned: `held_words` is None and the caller unswizzles (fingerprint.held_fingerprint), as it does
where the kernel does not run (`fingerprint` None).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offpolicy.rollout.engines import fingerprint_triton

LAYOUT = "HOPPER_VALUE"  # triton_kernels' HopperMXValueLayout.name
CHUNK = 1 << 22  # words unpacked a time by `torch_fingerprint` (~128 MB of int64 temporaries)
MASK = 0b10000001110000001000000111000000  # a bf16 pair's sign and exponent bits that carry an fp4's bits


def held_words(holder: object, t: torch.Tensor) -> torch.Tensor | None:
    """The held memory of a kernel wrapper's storage (`holder`, its tensor `t`) as the int32 words the Hopper value
    layout packs, or None where it is not that layout or not one word-aligned contiguous block."""
    if getattr(getattr(holder, "layout", None), "name", None) != LAYOUT or t.dtype != torch.uint8 or t.dim() < 2:
        return None
    held = t if t.is_contiguous() else t.mT if t.mT.is_contiguous() else None  # mx_axis: the layout's transposed view
    if held is None or held.numel() % 4 or held.storage_offset() % 4:
        return None
    return held.reshape(-1).view(torch.int32)


def unpacked(words: torch.Tensor) -> torch.Tensor:
    """The four bytes each int32 word unpacks to (uint8, [n, 4]): the word's four bf16-positioned pairs of fp4 values
    (its bits as they are, shifted left by 3 and 6, and the fourth value's scattered bits gathered), each pair's 16-bit
    halves read back as fp4 (sign bit 15, exponent-mantissa bits 6-8), the low half the low nibble."""
    x = words.to(torch.int64) & 0xFFFFFFFF
    fourth = ((x << 1) & 0x80008000) | ((x >> 3) & 0x01800180) | ((x >> 7) & 0x00400040)
    pairs = torch.stack([x & MASK, (x << 3) & MASK, (x << 6) & MASK, fourth], dim=-1)
    lo, hi = pairs & 0xFFFF, pairs >> 16
    nibble = lambda h: (((h >> 15) & 1) << 3) | ((h >> 6) & 7)  # noqa: E731
    return (nibble(lo) | (nibble(hi) << 4)).to(torch.uint8)


def fingerprint(words: torch.Tensor, bytes_fingerprint: Callable[[torch.Tensor], int]) -> int | None:
    """The fingerprint of the bytes the int32 `words` unpack to (`unpacked`) by one Triton kernel, self-checked once a
    process and device against `torch_fingerprint` (the bytes hashed by `bytes_fingerprint`, fingerprint.
    tensor_fingerprint); None where the kernel does not run here or was refused: the caller then unswizzles, which
    is faster than `torch_fingerprint` (its int64 unpacking ran several times slower than triton_kernels' unswizzle
    and the histogram on a CPU: `benchmarks/fingerprint_speed.py`, docs/vllm.md)."""
    if not fingerprint_triton.hopper_available(words):
        return None
    return fingerprint_triton.hopper_fingerprint(words, lambda w: torch_fingerprint(w, bytes_fingerprint))


def torch_fingerprint(words: torch.Tensor, bytes_fingerprint: Callable[[torch.Tensor], int]) -> int:
    """`fingerprint` by torch alone (the kernel's reference), CHUNK words at a time (their unpacked bytes hashed by
    `bytes_fingerprint`)."""
    return sum(bytes_fingerprint(unpacked(words[i:i + CHUNK])) for i in range(0, words.numel(), CHUNK)) % (1 << 64)
