"""offpolicy.weights.lowbit_load through the torch engine (issue 53): a low-bit version (fp8, mxfp4) of a tiny bf16
GPT-OSS loads into the engine's own tensors in place, laid out exactly as a bf16 (native) load leaves them, with
values equal to a float64 dequantized reference rounded to bf16, and with temporaries bounded by the quantized
bytes plus one chunk (no second copy of the model: the load's peak, counted op by op)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offpolicy.config import WeightsConfig
from offpolicy.models.build import hf_config, hf_state
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightVersion, mxfp4, version_dir
from offpolicy.weights.formats import store_run
from offpolicy.weights.publisher import Publisher
from tests.unit.test_torch_engine_lowbit import BLOCK, config, reference, source_model

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create and that are still referenced, and their peak: what a block of torch
    code holds beyond the tensors it was given (an op's output that aliases an input, a view or an in-place
    write, allocates nothing). Counts torch ops only; preadv into existing tensors allocates nothing either."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.now = self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in given | {0}:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.live:
                self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.now += self.live[key][0]
                self.peak = max(self.peak, self.now)
            self.live[key][1] += 1
            weakref.finalize(t, self._drop, key)
        return out


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowbit")
    src = source_model()
    pub = Publisher(WeightsConfig(root=str(root), keep=2, formats=["native", "fp8", "mxfp4"], fp8_block_size=BLOCK),
                    "run")
    pub.publish(1, lambda: hf_state(src), hf_config(src))
    return root


def engine(fmt: str, double_buffer: bool) -> TorchEngine:
    return TorchEngine(config("model.dtype=bfloat16", f"rollout.weights_format={fmt}", "weights.formats=[fp8, mxfp4]",
                              f"rollout.double_buffer={str(double_buffer).lower()}"), seed=0)


def load(eng: TorchEngine, root, fmt: str) -> None:
    with WeightVersion(version_dir(root, store_run("run", fmt), 1)) as wv:
        eng.load(wv)


def layout(eng: TorchEngine) -> dict[str, tuple]:
    return {n: (p.dtype, tuple(p.shape), p.stride(), p.is_contiguous()) for n, p in eng.model.named_parameters()}


@pytest.mark.parametrize("double_buffer", [False, True])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_a_low_bit_load_leaves_the_parameters_as_a_bf16_load_does(published, fmt, double_buffer):
    bf16 = engine("native", double_buffer)
    load(bf16, published, "native")
    low = engine(fmt, double_buffer)
    before = {n: p.data_ptr() for n, p in low.model.named_parameters()}
    load(low, published, fmt)
    try:
        assert layout(low) == layout(bf16)  # dtype, shape, strides, contiguity of every parameter
        if not double_buffer:  # in place: the parameters keep their storage (the double buffer swaps in its spare)
            assert {n: p.data_ptr() for n, p in low.model.named_parameters()} == before
        ref = reference(version_dir(published, store_run("run", fmt), 1), fmt)
        state = dict(hf_state(low.model))
        for name, want in ref.items():  # float64 dequantized, rounded once to bf16 (each value fits: bit for bit)
            assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], want.to(torch.bfloat16)), name
    finally:
        bf16.close()
        low.close()


def test_an_mxfp4_load_holds_the_quantized_bytes_and_one_chunk_at_most(published, monkeypatch):
    monkeypatch.setattr(mxfp4, "CHUNK", 1024)
    eng = engine("mxfp4", False)
    experts = sum(p.numel() * p.element_size() for n, p in eng.model.named_parameters() if n.endswith(EXPERTS))
    with WeightVersion(version_dir(published, store_run("run", "mxfp4"), 1)) as wv:
        quantized = sum(t.numel() * t.element_size() for n, t in wv.tensors.items() if n.endswith(("_blocks", "_scales")))
        with torch.no_grad(), LiveBytes() as live:
            eng.load(wv)
    chunk = mxfp4.CHUNK * (4 + 2)  # an int32 index per byte (two elements) and a float32 value per element
    assert live.peak <= quantized + 2 * chunk, (live.peak, quantized, experts)
    assert live.peak < experts / 2, (live.peak, experts)  # never a dequantized copy of the experts
    assert live.now <= 256 * 2 * 4, live.live  # nothing left behind but the byte -> values table (kept per device)
    print(f"peak {live.peak} B: quantized {quantized} B, experts in bf16 {experts} B")
