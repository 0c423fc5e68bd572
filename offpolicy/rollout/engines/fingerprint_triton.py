"""The weight fingerprint's sum (fingerprint.py) in one Triton kernel: each element's bits mixed by splitmix64 in
registers and summed per block, the blocks' sums added by torch: an element is read once and nothing is written but
one int64 a block. The torch paths it stands in for on a GPU go through memory: the histogram (`bincount` with one
atomic per element) or the element-wise sum's ten int64 kernels, both far below the memory's bandwidth; in the vLLM
and SGLang workers the model's fingerprint was a sizeable part of each load, on the rollout's critical path
(measured: docs/vllm.md, "Every version is proven, not assumed"; docs/benchmarks.md).

`fingerprint(flat)` equals `fingerprint.tensor_fingerprint` for 1-, 2- and 4-byte elements (floats, uint8, int8):
the same splitmix64 finalizer in wrapping int64 arithmetic (logical shifts masked, as `fingerprint.mix`), an element
that equals zero counting nothing. Which bit patterns equal zero is read from the dtype itself, as torch compares its
values with 0 (`_zero_rule`): +0 and -0 of IEEE-like floats (every bit but the sign clear), 0 alone of integers, of
the `fnuz` float8 dtypes (whose 0x80 is NaN) and of float8_e8m0fnu; a dtype whose zeros follow none of these rules
is left to the torch paths. Runs where `plumbing.triton_gate.runs` says (CUDA, or Triton's interpreter in the
CPU tests; OFFPOLICY_EAGER_FINGERPRINT=1 turns it off). On its first use in a process the kernel is checked against
the torch paths on a small tensor of every bit pattern of each dtype it meets; a mismatch is logged once and the torch
paths serve from then on, so a kernel that computed wrongly on some GPU could only slow a proof, never fail one.

A second kernel (`hopper_fingerprint`) hashes MXFP4 expert values held in triton_kernels' Hopper value layout as the
bytes their int32 words unpack to (hopper_value_hash.py), in one pass, self-checked the same way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from offpolicy.plumbing.triton_gate import runs

log = logging.getLogger("offpolicy.fingerprint")

SWITCH = "OFFPOLICY_EAGER_FINGERPRINT"
BLOCK = 4096  # elements a program
HOPPER_BLOCK = BLOCK // 4  # words a program of the Hopper value kernel (4 bytes each)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)
_refused: set[torch.dtype] = set()  # dtypes whose self-check failed in this process
_passed: set[tuple[torch.dtype, str]] = set()  # (dtype, device) whose self-check held


def available(flat: torch.Tensor) -> bool:
    """Whether the kernel fingerprints `flat` (a 1-D float, uint8 or int8 tensor) here."""
    dtype = flat.dtype
    return (flat.element_size() in _BITS and dtype not in _refused and runs(flat.device.type, SWITCH)
            and _zero_rule(dtype) is not None)


def fingerprint(flat: torch.Tensor, reference: Callable[[torch.Tensor], int]) -> int | None:
    """`fingerprint.tensor_fingerprint` of the 1-D tensor `flat` (`available`), or None where the kernel was refused
    for its dtype (the caller's torch paths then). `reference`: the torch paths' fingerprint of a 1-D tensor, which the
    kernel's first use for a dtype is checked against (`_checked`)."""
    if not _checked(flat.dtype, flat.device, reference):
        return None
    return _run(flat)


def _run(flat: torch.Tensor) -> int:
    size = flat.element_size()
    width, zero_mask = (1 << (8 * size)) - 1, _zero_rule(flat.dtype)
    bits = flat.contiguous().view(_BITS[size])
    n = bits.numel()
    blocks = -(-n // BLOCK)
    partial = torch.empty(blocks, dtype=torch.int64, device=flat.device)
    _kernel()[(blocks,)](bits, partial, n, zero_mask, WIDTH=width, COUNT_ALL=zero_mask == 0, BLOCK=BLOCK,
                         GOLDEN=_GOLDEN, MUL1=_MUL1, MUL2=_MUL2, LOW30=(1 << 34) - 1, LOW27=(1 << 37) - 1,
                         LOW31=(1 << 33) - 1)
    return int(partial.sum().item()) % (1 << 64)  # int64 sums wrap: exact mod 2^64


def hopper_available(words: torch.Tensor) -> bool:
    """Whether `hopper_fingerprint` runs the kernel for these int32 words (hopper_value_hash.py) here."""
    return words.dtype == torch.int32 and str(words.device) not in _hopper_refused and runs(words.device.type, SWITCH)


def hopper_fingerprint(words: torch.Tensor, reference: Callable[[torch.Tensor], int]) -> int | None:
    """The fingerprint of the bytes the int32 `words` of triton_kernels' Hopper MXFP4 value layout unpack to
    (hopper_value_hash.py), by one kernel; None where its self-check against `reference` (the torch path, on words of
    every kind of bit: zeros, sign bits, random, over several blocks) failed in this process."""
    key = str(words.device)
    if key not in _hopper_passed:
        g = torch.Generator().manual_seed(0)
        sample = torch.randint(-(1 << 31), (1 << 31) - 1, (3 * BLOCK + 17,), generator=g, dtype=torch.int32)
        sample[::7], sample[1::11], sample[2::13] = 0, -(1 << 31), -1
        if not _agrees(_hopper_run, sample.to(words.device), reference, "Hopper MXFP4 values"):
            _hopper_refused.add(key)
            return None
        _hopper_passed.add(key)
    return _hopper_run(words)


_hopper_refused: set[str] = set()  # devices whose self-check failed (hopper_fingerprint)
_hopper_passed: set[str] = set()


def _hopper_run(words: torch.Tensor) -> int:
    n = words.numel()
    blocks = -(-n // HOPPER_BLOCK)
    partial = torch.empty(blocks, dtype=torch.int64, device=words.device)
    _hopper_kernel()[(blocks,)](words.contiguous(), partial, n, BLOCK=HOPPER_BLOCK, GOLDEN=_GOLDEN, MUL1=_MUL1,
                                MUL2=_MUL2, LOW30=(1 << 34) - 1, LOW27=(1 << 37) - 1, LOW31=(1 << 33) - 1)
    return int(partial.sum().item()) % (1 << 64)  # int64 sums wrap: exact mod 2^64


@functools.cache
def _zero_rule(dtype: torch.dtype) -> int | None:
    """The bits that must be clear for an element of `dtype` to equal zero (all but the sign bit, or all), 0 where no
    pattern equals zero, None where its zeros follow no such rule (or the dtype is not 1, 2 or 4 bytes)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if size not in _BITS or not (dtype.is_floating_point or dtype in (torch.uint8, torch.int8)):
        return None
    width = 8 * size
    if size == 4:  # float32: IEEE (2^32 patterns are not enumerated)
        return (1 << 31) - 1 if dtype == torch.float32 else None
    patterns = torch.arange(1 << width, dtype=torch.int64)
    values = patterns.to(torch.int32).to(_BITS[size]).view(dtype)
    zeros = set(patterns[values == 0].tolist())
    sign = 1 << (width - 1)
    for mask, expected in ((0, set()), ((1 << width) - 1, {0}), (sign - 1, {0, sign})):
        if zeros == expected:
            return mask
    return None


def _checked(dtype: torch.dtype, device: torch.device, reference: Callable[[torch.Tensor], int]) -> bool:
    """Whether the kernel agrees with `reference` for `dtype` on `device` (checked once a process and dtype): every
    bit pattern of a 1- or 2-byte dtype and some of float32's, zeros among them, over several blocks."""
    if dtype in _refused:
        return False
    if (dtype, str(device)) in _passed:
        return True
    size = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    if size < 4:
        raw = torch.arange(1 << (8 * size), dtype=torch.int32).to(_BITS[size]).repeat(3)
    else:
        raw = torch.randint(-(1 << 31), (1 << 31) - 1, (3 * BLOCK + 17,), generator=g, dtype=torch.int32)
        raw[::7] = 0
        raw[1::11] = -(1 << 31)  # -0.0
    if not _agrees(_run, raw.view(dtype).to(device), reference, str(dtype)):
        _refused.add(dtype)
        return False
    _passed.add((dtype, str(device)))
    return True


def _agrees(run: Callable[[torch.Tensor], int], sample: torch.Tensor, reference: Callable[[torch.Tensor], int],
            what: str) -> bool:
    """Whether a kernel's `run` of `sample` equals the torch paths' `reference` (an exception counts as a
    disagreement); a disagreement is warned: the torch paths then fingerprint `what` in this process."""
    want = reference(sample)
    try:
        got = run(sample)
    except Exception as e:  # noqa: BLE001 - any: the torch paths serve
        got = f"{type(e).__name__}: {e}"
    if got != want:
        log.warning("the Triton fingerprint of %s disagreed with the torch paths' on %s (%s against %s): they "
                    "fingerprint it in this process", what, sample.device, got, want)
    return got == want


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "zero_mask"])  # one compile a dtype: the self-check's sizes serve all
    def fingerprint_kernel(bits_ptr, out_ptr, n, zero_mask, WIDTH: tl.constexpr, COUNT_ALL: tl.constexpr,
                           BLOCK: tl.constexpr, GOLDEN: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                           LOW30: tl.constexpr, LOW27: tl.constexpr, LOW31: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        b = tl.load(bits_ptr + offs, mask=inside, other=0).to(tl.int64) & WIDTH  # the element's own bits, unsigned
        z = b + GOLDEN
        z = (z ^ ((z >> 30) & LOW30)) * MUL1  # logical shifts of int64: the sign's copies masked off
        z = (z ^ ((z >> 27) & LOW27)) * MUL2
        z = z ^ ((z >> 31) & LOW31)
        if COUNT_ALL:
            counted = inside
        else:
            counted = inside & ((b & zero_mask) != 0)
        tl.store(out_ptr + pid, tl.sum(tl.where(counted, z, tl.zeros_like(z)), axis=0))

    return fingerprint_kernel


@functools.cache
def _hopper_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # one compile a process: the self-check's size serves every tensor's
    def hopper_value_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr, GOLDEN: tl.constexpr, MUL1: tl.constexpr,
                            MUL2: tl.constexpr, LOW30: tl.constexpr, LOW27: tl.constexpr, LOW31: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(words_ptr + offs, mask=inside, other=0).to(tl.int64) & 0xFFFFFFFF  # the word, unsigned
        m = 0b10000001110000001000000111000000
        fourth = ((x << 1) & 0x80008000) | ((x >> 3) & 0x01800180) | ((x >> 7) & 0x00400040)
        k = tl.arange(0, 4)[None, :].to(tl.int64)  # the word's four pairs of fp4 values, a column each
        pair = tl.where(k == 3, fourth[:, None], (x[:, None] << (3 * k)) & m)
        lo = pair & 0xFFFF
        hi = pair >> 16  # pair < 2^32, non-negative: a logical shift
        b = (((lo >> 15) & 1) << 3) | ((lo >> 6) & 7) | (((((hi >> 15) & 1) << 3) | ((hi >> 6) & 7)) << 4)
        z = b + GOLDEN  # splitmix64 of each byte, as the other kernel
        z = (z ^ ((z >> 30) & LOW30)) * MUL1
        z = (z ^ ((z >> 27) & LOW27)) * MUL2
        z = z ^ ((z >> 31) & LOW31)
        counted = inside[:, None] & (b != 0)
        tl.store(out_ptr + pid, tl.sum(tl.sum(tl.where(counted, z, tl.zeros_like(z)), axis=1), axis=0))

    return hopper_value_kernel
