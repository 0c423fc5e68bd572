"""offpolicy/rollout/engines/sglang/mxfp4_inplace.py against a stand-in of SGLang 0.5.14's MXFP4 GPT-OSS experts on
Hopper (mxfp4.py:807-836): the values and scales in triton_kernels wrappers held by the quant method, swizzled from the
loaded parameters transposed (the stand-in layout of tests/kernel_wrappers.py reverses and nibble-swaps, so only the
right bytes in the right order read back right), the scales' Parameter kept beside its copy, the biases float32. A
later version goes into the running wrappers in place: read back it is the version's, and the model's fingerprint is
the files' (the load's proof would pass); what cannot be written is logged and left, and nothing raises out of the
loader."""

from __future__ import annotations

import logging

import pytest
import torch

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines import mxfp4_kernels
from offpolicy.rollout.engines.sglang import mxfp4_inplace
from tests.kernel_wrappers import GptOss, ValueLayout, gptoss_version
from tests.kernel_wrappers import Wrapped as KernelTensor

E, H, I = 3, 64, 32  # experts, hidden, intermediate: values [E, rows, cols / 32, 16], scales [E, rows, cols / 32]


def Wrapped(param: torch.Tensor) -> KernelTensor:
    """A parameter as SGLang's `_swizzle_mxfp4` wraps it: transposed, then swizzled by the wrapper's layout."""
    layout = ValueLayout()
    return KernelTensor(layout.swizzle_data(mxfp4_kernels.kernel_ready("scale", param)), layout)


class PrecisionConfig:
    def __init__(self, scales):
        self.weight_scale = Wrapped(scales)


class QuantMethod:
    pass


class Experts(torch.nn.Module):
    """What SGLang's process_weights_after_loading leaves of loaded MXFP4 experts (triton_kernels backend)."""

    def __init__(self, parts: dict[str, torch.Tensor], experts: int = E):
        super().__init__()
        self.quant_method = QuantMethod()
        for proj, ckpt in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            blocks, scales = parts[f"{ckpt}_blocks"], parts[f"{ckpt}_scales"]
            setattr(self.quant_method, f"{proj}_weight_triton_tensor",
                    Wrapped(blocks.reshape(experts, blocks.shape[1], -1)))
            setattr(self.quant_method, f"{proj}_precision_config", PrecisionConfig(scales))
            setattr(self, f"{proj}_weight_scale", torch.nn.Parameter(scales.clone(), requires_grad=False))
            setattr(self, f"{proj}_weight_bias", torch.nn.Parameter(parts[f"{ckpt}_bias"].float(), requires_grad=False))


def Model(files: dict[str, torch.Tensor]) -> GptOss:
    return GptOss(files, Experts, H, E)


def version(seed: int) -> dict[str, torch.Tensor]:
    return gptoss_version(seed, E, H, I)


def held_values(model: Model, layer: int, proj: str) -> torch.Tensor:
    st = getattr(model.model.layers[layer].mlp.experts.quant_method, f"{proj}_weight_triton_tensor").storage
    return st.layout.unswizzle_data(st.data).transpose(-2, -1)


def test_a_version_goes_into_the_running_kernels_storage_and_hashes_as_its_files():
    first, second = version(0), version(1)
    model = Model(first)
    with torch.no_grad():
        for name, t in first.items():
            if ".router." in name:
                dict(model.named_parameters())[name].copy_(t)
    mxfp4_inplace.offpolicy_load_mxfp4(model, list(second.items()))
    for i in range(2):
        experts = model.model.layers[i].mlp.experts
        for proj, ckpt in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            part = f"model.layers.{i}.mlp.experts.{ckpt}"
            blocks = second[f"{part}_blocks"]
            assert torch.equal(held_values(model, i, proj), blocks.reshape(E, blocks.shape[1], -1))  # byte order too
            assert torch.equal(getattr(experts, f"{proj}_weight_scale"), second[f"{part}_scales"])
            assert torch.equal(getattr(experts, f"{proj}_weight_bias"), second[f"{part}_bias"].float())
    assert sorted(model.loaded) == sorted(n for n in second if ".router." in n)  # the rest: SGLang's own loader
    files = fp.files_fingerprint(second.items(), torch.bfloat16, widened_biases=True)
    assert fp.total(fp.model_fingerprints(model).values()) == files  # what the load's proof compares


def test_kernel_tensors_made_in_inference_mode_are_written_too():
    """SGLang may build its kernels' tensors under torch.inference_mode; such a tensor takes an in-place write only
    inside it (outside: RuntimeError, which the loader would log and the proof then refuse)."""
    first, second = version(0), version(1)
    model = Model(first)
    for layer in model.model.layers:
        qm = layer.mlp.experts.quant_method
        for st in (qm.w13_weight_triton_tensor.storage, qm.w2_precision_config.weight_scale.storage):
            with torch.inference_mode():
                st.data = st.data.clone()
            assert st.data.is_inference()
    mxfp4_inplace.offpolicy_load_mxfp4(model, list(second.items()))
    blocks = second["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    assert torch.equal(held_values(model, 1, "w13"), blocks.reshape(E, blocks.shape[1], -1))


def test_what_cannot_be_written_is_left_and_said_and_nothing_raises(caplog):
    first = version(0)
    model = Model(first)
    bad = {k: (torch.cat([v, v[:, :2]], 1) if k.endswith("gate_up_proj_blocks") else v)
           for k, v in version(1).items()}  # more than the layer holds (fewer rows are zero-padded, as SGLang's loader)
    before = held_values(model, 0, "w13").clone()
    with caplog.at_level(logging.ERROR, logger="offpolicy.sglang"):
        mxfp4_inplace.offpolicy_load_mxfp4(model, list(bad.items()))
    assert torch.equal(held_values(model, 0, "w13"), before)
    assert "left 2 expert tensors as they were" in caplog.text and "w13 value: swizzled" in caplog.text

    def broken(named):
        raise KeyError("model.layers.0.mlp.router.weight")

    caplog.clear()
    model.load_weights = broken
    with caplog.at_level(logging.ERROR, logger="offpolicy.sglang"):
        mxfp4_inplace.offpolicy_load_mxfp4(model, list(version(2).items()))  # would end SGLang's scheduler
    assert "offpolicy's MXFP4 loader failed" in caplog.text and "KeyError" in caplog.text


@pytest.mark.parametrize("name, expected", [
    ("model.layers.3.mlp.experts.gate_up_proj_blocks", ("model.layers.3.mlp.experts", "w13", "value")),
    ("model.layers.3.mlp.experts.down_proj_bias", ("model.layers.3.mlp.experts", "w2", "bias")),
    ("model.layers.3.mlp.router.weight", None), ("model.layers.3.self_attn.sinks", None)])
def test_the_experts_are_told_from_the_rest_by_name(name, expected):
    experts, rest = mxfp4_kernels.split([(name, torch.zeros(1))])
    assert ([e[:3] for e in experts] == [expected]) if expected else (rest and not experts)


GPTOSS_MXFP4 = ["model.arch.model_type=gpt_oss", "rollout.engine=sglang", "weights.formats=[mxfp4]",
                "rollout.weights_format=mxfp4"]


def test_inplace_mxfp4_loads_take_tensors_on_a_gpu_and_are_refused_where_they_could_not():
    """`rollout.sglang.mxfp4_load: inplace` makes the in-process engine take MXFP4 versions as tensors on its GPU
    (`staged.from_tensors`), through this loader, registered beside offpolicy's others; a sharded engine or one that
    would read versions from disk (SGLang's own MXFP4 reload raises in its scheduler) is refused, naming the field."""
    from offpolicy.config import load_config
    from offpolicy.config.schema import ConfigError
    from offpolicy.rollout.engines.sglang import local, staged

    inplace = load_config(None, [*GPTOSS_MXFP4, "rollout.sglang.mxfp4_load=inplace"])
    default = load_config(None, GPTOSS_MXFP4)  # mxfp4_load auto
    restart = load_config(None, [*GPTOSS_MXFP4, "rollout.sglang.mxfp4_load=restart"])
    assert mxfp4_inplace.LOADER in local.engine_kwargs(inplace, 0, model_path="/v0", weight_version=0)[
        "custom_weight_loader"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staged, "engine_device", lambda cfg: torch.device("cuda", 0))
        assert staged.from_tensors(inplace) and staged.prefetch_of(inplace) == "device"  # staged ahead once the
        # first version has started the engine (LocalBackend.stages_ahead)
        assert staged.mxfp4_in_place(default) and not staged.mxfp4_in_place(restart)  # auto: in place on a GPU
        sharded = load_config(None, [*GPTOSS_MXFP4, "rollout.sglang.tp_size=2"])
        assert not staged.mxfp4_in_place(sharded)  # auto: a restart where the loader cannot write
    if not torch.cuda.is_available():  # auto restarts where versions would come from disk
        assert not staged.mxfp4_in_place(default) and not staged.from_tensors(default)
    if not torch.cuda.is_available():  # on a CPU the engine's versions would come from disk
        with pytest.raises(ValueError, match="rollout.sglang.mxfp4_load=inplace .* no CUDA device .* from disk"):
            local.LocalBackend(inplace, seed=0)
    for bad in ("rollout.sglang.dp_size=2", "rollout.sglang.ep_size=2"):
        with pytest.raises(ConfigError, match="rollout.sglang.mxfp4_load: is inplace .* one in-process engine"):
            load_config(None, [*GPTOSS_MXFP4, "rollout.sglang.mxfp4_load=inplace", "rollout.sglang.tp_size=2", bad])
    tp2 = load_config(None, [*GPTOSS_MXFP4, "rollout.sglang.mxfp4_load=inplace", "rollout.sglang.tp_size=2"])
    # asked for: each TP worker writes its part
    assert staged.mxfp4_in_place(tp2)
    for bad in ("rollout.device=cpu", "rollout.sglang.prefetch=disk"):  # versions read from disk: refused at the load
        with pytest.raises(ConfigError, match="rollout.sglang.mxfp4_load: is inplace .* tensors on the engine's GPU"):
            load_config(None, [*GPTOSS_MXFP4, "rollout.sglang.mxfp4_load=inplace", bad])


@pytest.mark.parametrize("cuts", [
    [mxfp4_kernels.Shard(tp_size=2, tp_rank=r) for r in range(2)],  # MoE TP: I = 96 in 3 blocks, 2 and 1 a rank
    [mxfp4_kernels.Shard(ep_size=3, ep_rank=r) for r in range(3)],  # EP: one expert a rank
    [mxfp4_kernels.Shard(2, t, 3, e) for t in range(2) for e in range(3)]])  # both, as SGLang's loader can
def test_each_tp_worker_of_a_sharded_engine_writes_its_part_as_sglang_cut_it(monkeypatch, cuts):
    """SGLang 0.5.14's GPT-OSS loader cuts the experts over EP and the intermediate dimension over MoE TP (rows
    padded to a multiple of 64 with the triton_kernels MoE, down's bias on MoE-TP rank 0): each worker's loader call
    writes its part of the next version, and the workers' fingerprints add up to the files' (the load's proof)."""
    inter, held = 96, 64
    v0, v1 = (gptoss_version(s, E, H, inter) for s in (0, 1))

    def worker(files, cut):
        parts = {}
        for name, t in files.items():
            where = mxfp4_kernels.expert_part(name)
            parts[name] = mxfp4_kernels.as_held(torch.zeros(1, 2 * held), where[1], where[2],
                                                cut.cut(where[1], where[2], t)) if where else t
        experts = len(parts["model.layers.0.mlp.experts.gate_up_proj_bias"])
        return GptOss(parts, lambda p: Experts(p, experts), H, E)

    total = 0
    for cut in cuts:
        model = worker(v0, cut)
        monkeypatch.setattr(mxfp4_inplace, "shard", lambda: cut)
        mxfp4_inplace.offpolicy_load_mxfp4(model, list(v1.items()))
        want = worker(v1, cut)
        for i in range(2):
            for proj in ("w13", "w2"):
                assert torch.equal(held_values(model, i, proj), held_values(want, i, proj)), (cut, proj)
                for kept in ("weight_scale", "weight_bias"):
                    got, exp = (getattr(m.model.layers[i].mlp.experts, f"{proj}_{kept}") for m in (model, want))
                    assert torch.equal(got, exp.float() if kept == "weight_bias" else exp), (cut, proj, kept)
        total += fp.total(v for k, v in fp.model_fingerprints(model).items() if ".experts." in k)
    experts = [(k, t) for k, t in v1.items() if ".experts." in k]
    assert total % fp.M == fp.files_fingerprint(experts, torch.bfloat16, widened_biases=True)
