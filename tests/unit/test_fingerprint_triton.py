"""The fingerprint's Triton kernel (offpolicy/rollout/engines/fingerprint_triton.py) in Triton's interpreter on the CPU:
equal to the histogram and element-wise sums (and to the pure-Python definition) for every dtype a version holds,
zeros and negative zeros counting nothing; its self-check refuses a kernel that computes wrongly, and the torch paths
then serve. Skipped without the `triton` package; the kernel runs in a subprocess with TRITON_INTERPRET=1."""

import pytest

from tests.interpreter import assert_interpreted_ok

pytest.importorskip("triton")

CHECK = r"""
import torch
from offpolicy.rollout.engines import fingerprint as fp, fingerprint_triton as ft

g = torch.Generator().manual_seed(1)
for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu):
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (size * (2 * ft.BLOCK + 3),), generator=g, dtype=torch.uint8)  # 3 blocks, 1 partial
    t = raw.view(dtype)
    if dtype.is_floating_point and dtype != torch.float8_e8m0fnu:
        t[::5] = 0
        t[1::9] = -0.0
    assert ft.available(t), dtype
    bits = [int(b) & ((1 << (8 * size)) - 1) for b in raw.view(ft._BITS[size]).tolist()]
    zero = (t == 0).tolist()  # as the definition compares (NaN != 0: a NaN pattern counts)
    reference = sum(fp.mix_reference(b) for b, z in zip(bits, zero) if not z) % (1 << 64)
    got = fp.tensor_fingerprint(t)  # through the kernel (self-checked first)
    assert got == reference == fp.elementwise_fingerprint(t), dtype
    assert (dtype, "cpu") in ft._passed
assert ft._zero_rule(torch.float8_e4m3fnuz) == 0xFF and ft._zero_rule(torch.bfloat16) == 0x7FFF
assert ft._zero_rule(torch.int32) is None and ft._zero_rule(torch.float64) is None

# a kernel that computes wrongly is refused by its self-check: the torch paths fingerprint that dtype from then on
ft._passed.clear()
real = ft._run
ft._run = lambda flat: (real(flat) + 1) % (1 << 64)
t = torch.randn(1000).to(torch.bfloat16)
assert fp.tensor_fingerprint(t) == fp._histogram_fingerprint(t.reshape(-1), 1 << 24)
assert torch.bfloat16 in ft._refused and not ft.available(t)
ft._run = real
print("ok")
"""


def test_the_kernel_equals_the_definition_for_every_dtype_and_a_wrong_kernel_is_refused():
    assert_interpreted_ok(CHECK)


HOPPER = r"""
import torch
from offpolicy.rollout.engines import fingerprint as fp, fingerprint_triton as ft, hopper_value_hash as hv

g = torch.Generator().manual_seed(2)
words = torch.randint(-(1 << 31), (1 << 31) - 1, (2 * ft.BLOCK + 5,), generator=g, dtype=torch.int32)  # 1 partial
words[::3], words[1::7], words[2::11] = 0, -(1 << 31), -1
assert ft.hopper_available(words)
want = hv.torch_fingerprint(words, fp.elementwise_fingerprint)
assert hv.fingerprint(words, fp.tensor_fingerprint) == want  # through the kernel, self-checked first
assert "cpu" in ft._hopper_passed

# a model's MXFP4 experts in the Hopper value layout (a stand-in written from its format), in either orientation:
# hashed through the kernel, never unswizzled, like the checkpoint's bytes
from tests.kernel_wrappers import HopperValueLayout, Storage
b = torch.randint(0, 256, (3, 40, 24), generator=g, dtype=torch.uint8)
for transposed in (False, True):
    layout = HopperValueLayout(b.shape, transposed)
    held = Storage(layout.swizzle_data(b), layout)
    layout.unswizzle_data = None  # not called on this path
    assert fp.held_fingerprint(held, held.data) == fp.tensor_fingerprint(b)

# a kernel that computes wrongly is refused by its self-check: the torch path serves from then on
ft._hopper_passed.clear()
real = ft._hopper_run
ft._hopper_run = lambda w: (real(w) + 1) % (1 << 64)
assert hv.fingerprint(words, fp.tensor_fingerprint) is None  # the caller unswizzles
assert "cpu" in ft._hopper_refused and not ft.hopper_available(words)
print("ok")
"""


def test_the_hopper_value_kernel_equals_the_torch_path_and_a_wrong_kernel_is_refused():
    """hopper_value_hash.py's kernel: the bytes each int32 word unpacks to, mixed and summed in one pass, equal to
    unpacking them with torch and hashing element by element."""
    assert_interpreted_ok(HOPPER)
