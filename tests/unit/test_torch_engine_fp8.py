"""The torch engine's choice of fp8 matmul (rollout.fp8_matmul, issue 53) and its scaled path on the CPU: auto on a
CPU dequantizes and says why; a version read in scaled mode leaves every quantized linear in fp8 with its scales,
byte for byte the version's (in place and through the double buffer's banks), and the engine samples with
logprobs of the dequantize path's model with each fp8 linear's input rounded to e4m3 per 1 x 128 group (the
scaled math), and measurably not the dequantize path's own."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from offpolicy.config import ConfigError, WeightsConfig, load_config
from offpolicy.models.build import hf_config, hf_state
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.fp8_linear import GROUP, Fp8Linear, quantize_activations
from offpolicy.rollout.engines.fp8_matmul import Fp8Plan, check_version, targets
from offpolicy.rollout.engines.torch_engine import TorchEngine
from offpolicy.weights import WeightVersion, version_dir
from offpolicy.weights.formats import store_run
from offpolicy.weights.publisher import Publisher
from tests.unit.test_torch_engine_lowbit import BLOCK, PROMPTS, config, logprobs, source_model

FP8 = ("rollout.weights_format=fp8", "weights.formats=[fp8]", f"weights.fp8_block_size=[{BLOCK[0]}, {BLOCK[1]}]")


def publish(tmp_path, versions=(4,)):
    src = source_model()
    pub = Publisher(WeightsConfig(root=str(tmp_path), keep=3, formats=["fp8"], fp8_block_size=BLOCK), "run")
    for v in versions:
        with torch.no_grad():  # each version other weights
            for _, t in hf_state(src):
                if t.dim() >= 2:
                    t.mul_(1.0 + 0.01 * v)
        pub.publish(v, lambda: hf_state(src), hf_config(src))
    return [version_dir(tmp_path, store_run("run", "fp8"), v) for v in versions]


def raw(vdir) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(vdir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_fp8_auto_on_a_cpu_dequantizes_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="offpolicy.rollout.engines.torch"):
        engine = TorchEngine(config(*FP8), seed=0)
    assert engine.fp8.mode == "dequantize" and engine.fp8.reason == "no fp8 matmul kernel on cpu"
    assert not any(isinstance(m, Fp8Linear) for m in engine.model.modules())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fp8 versions")]
    assert lines == ["fp8 versions: dequantized to the model's dtype on load (no fp8 matmul kernel on cpu)"]
    assert TorchEngine(config(*FP8, "rollout.fp8_matmul=dequantize")).fp8.reason == "rollout.fp8_matmul=dequantize"
    assert TorchEngine(config()).fp8.mode == "off"  # native versions: nothing to choose
    mx = TorchEngine(config("rollout.weights_format=mxfp4", "weights.formats=[mxfp4]")).fp8
    assert mx.mode == "dequantize" and "SM100" in mx.reason


def test_fp8_matmul_scaled_is_refused_where_it_means_nothing():
    with pytest.raises(ConfigError, match="rollout.fp8_matmul"):
        config("rollout.fp8_matmul=scaled")  # native versions
    with pytest.raises(ConfigError, match="rollout.fp8_matmul"):
        config("rollout.weights_format=fp8", "weights.formats=[fp8]", "rollout.fp8_matmul=scaled", "rollout.engine=sglang")


def test_fp8_targets_are_the_quantized_linears_and_name_the_rest():
    class Odd(torch.nn.Module):  # a quantized 2-D weight held by no nn.Linear (as fused MoE experts are)
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(model_type="odd")
            self.q_proj = torch.nn.Linear(32, 16)
            self.experts = torch.nn.Module()
            self.experts.weight = torch.nn.Parameter(torch.zeros(16, 32))
            self.lm_head = torch.nn.Linear(32, 8)

    linears, strays = targets(Odd(), ("lm_head",))
    assert linears == {"q_proj": (16, 32)} and strays == ["experts.weight"]


def test_fp8_version_of_another_block_is_refused():
    p = Fp8Plan("scaled", "", "reference", (128, 128), ("m",))
    check_version(3, "fp8", {"weight_block_size": [128, 128]}, p)
    with pytest.raises(ValueError, match=r"in \[64, 64\] blocks, but the engine holds fp8 weights in \[128, 128\]"):
        check_version(3, "fp8", {"weight_block_size": [64, 64]}, p)
    with pytest.raises(ValueError, match="is native"):
        check_version(3, "native", {}, p)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_fp8_scaled_load_keeps_the_version_in_fp8_and_samples_as_the_dequantize_path(tmp_path, double_buffer):
    vdirs = publish(tmp_path, (4, 5))
    buf = f"rollout.double_buffer={str(double_buffer).lower()}"
    scaled = TorchEngine(config(*FP8, "rollout.fp8_matmul=scaled", buf), seed=0)
    plain = TorchEngine(config(*FP8, "rollout.fp8_matmul=dequantize", buf), seed=0)
    assert scaled.fp8.scaled and scaled.fp8.kernel == "reference" and scaled.fp8.block == BLOCK
    quantized = {n for n, t in raw(vdirs[0]).items() if t.dtype == torch.float8_e4m3fn}
    assert quantized and {m + ".weight" for m in scaled.fp8.modules} == quantized  # every 2-D projection
    assert (scaled.prefetcher is not None) == double_buffer

    for vdir in vdirs:
        with WeightVersion(vdir) as wv:
            scaled.load(wv)
            plain.load(wv)
        stored, state = raw(vdir), dict(hf_state(scaled.model))
        assert set(state) == set(stored)
        for name, t in stored.items():  # the version's bytes: fp8 weights, float32 scales, the rest as stored
            if t.dtype == torch.float8_e4m3fn:
                assert state[name].dtype == t.dtype and torch.equal(state[name].view(torch.uint8), t.view(torch.uint8))
            else:
                assert torch.equal(state[name], t.to(state[name].dtype)), name
        if double_buffer:  # the spare bank was read into, and the live one points at it
            assert scaled.prefetcher.live == plain.prefetcher.live == (vdirs.index(vdir) + 1) % 2

    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    out = scaled.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert scaled.version == plain.version == 5
    # the dequantize path's model with each fp8 linear's input rounded as the scaled path rounds it (per token, groups
    # of 128, e4m3): the scaled path's math, so its logprobs of the scaled engine's tokens are the engine's
    hooks = [plain.model.get_submodule(m).register_forward_pre_hook(fake_quant) for m in scaled.fp8.modules]
    got, want, dense = [], [], []
    for prompt, comps in zip(PROMPTS, out):
        for c in comps:
            got.append(torch.from_numpy(c.logprobs).double())
            want.append(logprobs(plain.model, prompt, c.tokens))
    for h in hooks:
        h.remove()
    for prompt, comps in zip(PROMPTS, out):
        for c in comps:
            dense.append(logprobs(plain.model, prompt, c.tokens))
    got, want, dense = torch.cat(got), torch.cat(want), torch.cat(dense)
    assert got.numel() >= 3 * 4 * 2
    off, off_dense = (got - want).abs().max().item(), (got - dense).abs().mean().item()
    assert off <= 1e-4, off  # float32, with a KV cache against one cache-free forward
    assert off_dense >= 10 * off and off_dense >= 1e-3, (off_dense, off)  # the activations' rounding shows


def fake_quant(module, args):
    """An nn.Linear's input quantized and dequantized per token in groups of 128, as `Fp8Linear` quantizes it."""
    (x,) = args
    q, s = quantize_activations(x.reshape(-1, x.shape[-1]))
    k = x.shape[-1]
    back = (q.float().view(q.shape[0], -1) * s.repeat_interleave(GROUP, 1)[:, :k]).to(x.dtype)
    return (back.reshape(x.shape),)


def test_fp8_scaled_engine_refuses_a_version_that_would_be_cast(tmp_path):
    vdir = publish(tmp_path)[0]
    engine = TorchEngine(config(*FP8, "rollout.fp8_matmul=scaled"), seed=0)
    name = engine.fp8.modules[0] + ".weight"
    mod = engine.model.get_submodule(engine.fp8.modules[0])
    mod.weight = torch.zeros(mod.weight.shape, dtype=torch.float32)  # as if this linear had stayed dense
    before = {n: t.clone() for n, t in hf_state(engine.model)}
    with WeightVersion(vdir) as wv, pytest.raises(ValueError, match=f"{name} torch.float8_e4m3fn into torch.float32"):
        engine.load(wv)
    assert all(torch.equal(t, before[n]) for n, t in hf_state(engine.model))  # refused before a byte was read
    assert json.loads((vdir / "config.json").read_text())["quantization_config"]["weight_block_size"] == list(BLOCK)
