"""offpolicy/rollout/engines/vllm/kernels.py (and its place in worker.py's load) against a stand-in of vLLM 0.26's
Triton MXFP4 GPT-OSS experts on Hopper (quantization/mxfp4.py 343-364, oracle/mxfp4.py 1135-1175): `mlp.experts` a
FusedMoE whose `routed_experts` child holds the values as triton_kernels wrappers (transposed, then swizzled by the
stand-in layout of tests/kernel_wrappers.py, which reverses and nibble-swaps: only the right bytes in the right order
read back right), the scales in its quant method's precision configs (transposed, their block dimension zero-padded
to a multiple of 4 as vLLM pads it on Hopper; the scale Parameters deleted), the biases float32. A version written in
place reads back as its files and the model hashes as them (the load's proof); what cannot be written makes the
worker rebuild."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from offpolicy.rollout.engines import fingerprint as fp
from offpolicy.rollout.engines.mxfp4_kernels import kernel_ready
from offpolicy.rollout.engines.vllm import kernels
from tests.kernel_wrappers import GptOss, ValueLayout, gptoss_version
from tests.kernel_wrappers import Wrapped as KernelTensor

E, H, I = 3, 96, 64  # scales' blocks: H / 32 = 3 and I / 32 = 2, padded to 4 as vLLM pads them


class ScaleLayout:  # the real one permutes bytes; the stand-in keeps them
    def swizzle_data(self, data):
        return data.contiguous()

    def unswizzle_data(self, data):
        return data


def wrapped(part: str, t: torch.Tensor) -> KernelTensor:
    """A checkpoint tensor as vLLM's `_swizzle_mxfp4` wraps it (with the logical `shape` triton_kernels keeps)."""
    ready = kernel_ready(part, t)
    if part == "scale":
        ready = torch.nn.functional.pad(ready, (0, 0, 0, -ready.shape[-2] % 4))
    layout = ValueLayout() if part == "value" else ScaleLayout()
    w = KernelTensor(layout.swizzle_data(ready), layout)
    w.shape = list(ready.shape)
    return w


class RoutedExperts(torch.nn.Module):
    def __init__(self, parts: dict[str, torch.Tensor]):
        super().__init__()
        self.quant_method = types.SimpleNamespace()
        for proj, ckpt in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            self.__dict__[f"{proj}_weight"] = wrapped("value", parts[f"{ckpt}_blocks"])  # not a Parameter
            setattr(self.quant_method, f"{proj}_precision_config",
                    types.SimpleNamespace(weight_scale=wrapped("scale", parts[f"{ckpt}_scales"])))
            setattr(self, f"{proj}_bias", torch.nn.Parameter(parts[f"{ckpt}_bias"].float(), requires_grad=False))


def FusedMoE(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
    """vLLM 0.26's `mlp.experts`: a module whose `routed_experts` child holds the experts."""
    fused = torch.nn.Module()
    fused.routed_experts = RoutedExperts(parts)
    return fused


def version(seed: int, rows_cut: int = 0) -> dict[str, torch.Tensor]:
    return gptoss_version(seed, E, H, I, rows_cut)


def running(files: dict[str, torch.Tensor], n_experts: int = E) -> GptOss:
    """vLLM's GPT-OSS as far as the load goes (tests/kernel_wrappers.py), holding version `files`."""
    model = GptOss(files, FusedMoE, H, n_experts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in files:
                p.copy_(files[name])
    return model


def held(model: GptOss, layer: int, proj: str, part: str) -> torch.Tensor:
    experts = model.model.layers[layer].mlp.experts.routed_experts
    w = experts.__dict__[f"{proj}_weight"] if part == "value" else getattr(
        experts.quant_method, f"{proj}_precision_config").weight_scale
    return w.storage.layout.unswizzle_data(w.storage.data).transpose(-2, -1)


def test_a_version_goes_into_the_running_kernels_storage_and_hashes_as_its_files():
    model, second = running(version(0)), version(1)
    storage = model.model.layers[0].mlp.experts.routed_experts.w13_weight.storage
    ptr = storage.data.data_ptr()
    assert kernels.writable(model) is None
    assert kernels.load(model, iter(second.items())) == []
    for i in range(2):
        experts = model.model.layers[i].mlp.experts.routed_experts
        for proj, ckpt in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            part = f"model.layers.{i}.mlp.experts.{ckpt}"
            blocks, scales = second[f"{part}_blocks"], second[f"{part}_scales"]
            assert torch.equal(held(model, i, proj, "value"), blocks.reshape(E, blocks.shape[1], -1))  # byte order
            padded = held(model, i, proj, "scale")
            assert torch.equal(padded[..., :scales.shape[-1]], scales) and not padded[..., scales.shape[-1]:].any()
            assert torch.equal(getattr(experts, f"{proj}_bias"), second[f"{part}_bias"].float())
    assert storage.data.data_ptr() == ptr  # in the memory the kernels (and the CUDA graphs) read
    assert sorted(model.loaded) == sorted(n for n in second if ".router." in n)  # the rest: vLLM's own loaders
    files = fp.files_fingerprint(second.items(), torch.bfloat16, widened_biases=True)
    assert fp.total(fp.model_fingerprints(model).values()) == files  # what the load's proof compares


def test_what_cannot_be_written_is_returned_and_other_wrappers_are_not_taken():
    model = running(version(0))
    refused = kernels.load(model, iter(version(1, rows_cut=-2).items()))  # more than the layer holds (another
    # model, another layout): values, scales and bias of w13 in each layer (fewer are zero-padded, as vLLM's loader)
    assert len(refused) == 6 and all("w13 value: swizzled" in r or "w13 scale: swizzled" in r or "w13_bias" in r
                                     for r in refused), refused
    other = running(version(0))
    del other.model.layers[1].mlp.experts.routed_experts.quant_method.w2_precision_config  # another MoE backend
    assert "model.layers.1.mlp.experts.routed_experts keeps kernel-wrapped weights" in kernels.writable(other)


@pytest.mark.parametrize("parallel, why", [
    ({}, None), ({"tensor_parallel_size": 1, "data_parallel_size": 1}, None),
    ({"tensor_parallel_size": 2}, "2 ranks (tensor_parallel_size 2 x data_parallel_size 1)"),
    ({"data_parallel_size": 4}, "4 ranks (tensor_parallel_size 1 x data_parallel_size 4)"),
    ({"enable_expert_parallel": True}, "expert parallelism (enable_expert_parallel)")])
def test_sharded_experts_are_told_from_the_parallel_config(parallel, why):
    assert kernels.sharded(types.SimpleNamespace(**parallel)) == why


class Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        raise AttributeError("attribute 'w13_weight' already exists")  # vLLM's, on kernel-wrapped experts


@pytest.fixture
def worker(monkeypatch):
    """worker.py's Extension on the stand-in model (vLLM's config context a no-op; a rebuild recorded, not run)."""
    from offpolicy.rollout.engines.vllm.worker import Extension

    monkeypatch.setitem(sys.modules, "vllm.config", types.SimpleNamespace(
        set_current_vllm_config=lambda cfg: __import__("contextlib").nullcontext()))

    class Worker(Extension):
        def __init__(self):
            self.model_runner = Runner(running(version(0)))
            self.model_config = types.SimpleNamespace(dtype=torch.bfloat16, model="/launch",
                                                      hf_config=types.SimpleNamespace(model_type="gpt_oss"))
            self.vllm_config = types.SimpleNamespace()
            self.rebuilt: list[str] = []

        def reload_weights(self, *args, **kwargs):
            self.model_runner.reload_weights(*args, **kwargs)

        def _offpolicy_rebuild(self, path):
            self.rebuilt.append(path)
            return {"copied": 0, "moved": 0, "moved_in": []}

    return Worker()


@pytest.mark.parametrize("stage", ["hash", "direct", "device"])
def test_the_worker_loads_mxfp4_experts_in_place_and_rebuilds_what_it_cannot_write(tmp_path, worker, stage):
    for v, cut in ((1, 0), (2, -2)):
        (tmp_path / f"v{v}").mkdir()
        save_file({k: t.contiguous() for k, t in version(v, cut).items()}, tmp_path / f"v{v}" / "model.safetensors")
    r = json.loads(worker.offpolicy_load(str(tmp_path / "v1"), "inplace", stage))
    assert r["method"] == "inplace" and r["kernels"] is True and "reason" not in r and worker.rebuilt == []
    files = fp.files_fingerprint(version(1).items(), torch.bfloat16, widened_biases=True)
    assert int(r["files"]) == files and fp.total(int(t) for t in r["tensors"].values()) == files  # proven
    r = json.loads(worker.offpolicy_load(str(tmp_path / "v2"), "inplace", stage))  # shapes it cannot write
    assert r["method"] == "rebuild" and "offpolicy's MXFP4 load could not write" in r["reason"]
    assert worker.rebuilt == [str(tmp_path / "v2")]


def test_a_server_with_sharded_experts_rebuilds_without_trying(tmp_path, worker):
    (tmp_path / "v1").mkdir()
    save_file({k: t.contiguous() for k, t in version(1).items()}, tmp_path / "v1" / "model.safetensors")
    worker.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=2))
    r = json.loads(worker.offpolicy_load(str(tmp_path / "v1"), "inplace", "hash"))
    assert r["method"] == "rebuild" and "does not write them (2 ranks" in r["reason"] and "kernels" not in r


def rank_part(shard: kernels.Shard, proj: str, part: str, t: torch.Tensor, held_inter: int) -> torch.Tensor:
    """What vLLM 0.26's GPT-OSS MXFP4 loader leaves in a worker's zeroed parameter (written out here apart from
    kernels.Shard: `models/gpt_oss.py` `_load_weights_mxfp4`, `routed_experts.py` `weight_loader`)."""
    if shard.ep_size > 1:
        per = t.shape[0] // shard.ep_size
        return t[shard.ep_rank * per:(shard.ep_rank + 1) * per].clone()
    if proj == "w2" and part == "bias":
        return t.clone() if shard.tp_rank == 0 else torch.zeros_like(t)
    inter = t.shape[1] // 2 if proj == "w13" else t.shape[2] * 32
    per_rank = -(-(inter // 32) // shard.tp_size) * 32
    start, end = shard.tp_rank * per_rank, min((shard.tp_rank + 1) * per_rank, inter)
    if proj == "w13":
        out = torch.zeros((t.shape[0], 2 * held_inter, *t.shape[2:]), dtype=t.dtype)
        out[:, :2 * (end - start)] = t[:, 2 * start:2 * end]
    else:
        out = torch.zeros((*t.shape[:2], held_inter // 32, *t.shape[3:]), dtype=t.dtype)
        out[:, :, :(end - start) // 32] = t[:, :, start // 32:end // 32]
    return out


def worker_model(files: dict[str, torch.Tensor], shard: kernels.Shard, held_inter: int) -> GptOss:
    """A worker's running model holding its part of version `files`, its layers saying how vLLM cut them."""
    parts = {}
    for name, t in files.items():
        where = kernels.expert_part(name)
        parts[name] = rank_part(shard, where[1], where[2], t, held_inter) if where else t
    model = running(parts, files["model.layers.0.mlp.router.weight"].shape[0])
    for layer in model.model.layers:
        layer.mlp.experts.routed_experts.moe_config = types.SimpleNamespace(moe_parallel_config=types.SimpleNamespace(
            tp_size=shard.tp_size, tp_rank=shard.tp_rank, ep_size=shard.ep_size, ep_rank=shard.ep_rank,
            use_ep=shard.ep_size > 1, enable_eplb=False))
    return model


def experts_fingerprint(model: GptOss) -> int:
    return fp.total(v for k, v in fp.model_fingerprints(model).items() if ".experts." in k)


@pytest.mark.parametrize("shards, inter, held_inter", [
    ([kernels.Shard(2, r) for r in range(2)], 96, 64),  # 3 blocks: 2 and 1 a rank, each padded to vLLM's 64
    ([kernels.Shard(4, r) for r in range(4)], 128, 64),  # 4 blocks: 1 a rank, padded to 64
    ([kernels.Shard(ep_size=2, ep_rank=r) for r in range(2)], 64, 64)])  # experts 0-1 and 2-3
def test_each_worker_of_a_sharded_server_writes_its_part_as_vllm_cut_it(shards, inter, held_inter):
    """TP (the intermediate dimension cut in blocks, the last rank's short, every rank's zero-padded to what it
    holds; down's bias on rank 0 only) and EP (whole experts a rank): each worker's experts read back as vLLM's loader
    would have laid the new version out, and the workers' fingerprints add up to the files' (the load's proof)."""
    v0, v1 = (gptoss_version(s, 4, H, inter) for s in (0, 1))
    models = [worker_model(v0, s, held_inter) for s in shards]
    assert all(kernels.uncut(m, types.SimpleNamespace(tensor_parallel_size=2)) is None for m in models)
    for shard, model in zip(shards, models):
        assert kernels.load(model, iter(v1.items())) == []
        want = worker_model(v1, shard, held_inter)
        for i in range(2):
            for proj in ("w13", "w2"):
                for part in ("value", "scale"):
                    assert torch.equal(held(model, i, proj, part), held(want, i, proj, part)), (shard, proj, part)
                got, exp = (getattr(m.model.layers[i].mlp.experts.routed_experts, f"{proj}_bias")
                            for m in (model, want))
                assert torch.equal(got, exp)
    experts = {k: t for k, t in v1.items() if ".experts." in k}
    assert sum(experts_fingerprint(m) for m in models) % fp.M == fp.files_fingerprint(
        experts.items(), torch.bfloat16, widened_biases=True)


def test_a_sharded_server_whose_cut_is_unknown_rebuilds():
    model = running(version(0))  # no moe_config: how vLLM cut the experts is not known
    tp2 = types.SimpleNamespace(tensor_parallel_size=2)
    assert "2 ranks (tensor_parallel_size 2 x data_parallel_size 1), and model.layers.0" in kernels.uncut(model, tp2)
    assert kernels.uncut(model, types.SimpleNamespace()) is None  # whole: nothing to cut
    balanced = worker_model(version(0), kernels.Shard(ep_size=3), I)
    balanced.model.layers[1].mlp.experts.routed_experts.moe_config.moe_parallel_config.enable_eplb = True
    assert "eplb" in kernels.uncut(balanced, types.SimpleNamespace(enable_expert_parallel=True))


def test_a_version_prepared_ahead_is_only_copied_at_the_load(monkeypatch):
    """`prepare` (a staging's, in the background) swizzles the experts' values and scales as the running wrappers hold
    them; the load given them swizzles nothing and leaves the model as a load without them does."""
    model, plain, second = running(version(0)), running(version(0)), version(1)
    prepared = kernels.prepare(model, second.items())
    assert sorted(prepared) == sorted(n for n in second if n.endswith(("_blocks", "_scales")))  # no biases, no rest
    assert kernels.prepared_bytes(model) == sum(t.nbytes for t in prepared.values())
    calls = []
    monkeypatch.setattr(ValueLayout, "swizzle", staticmethod(lambda d, f=ValueLayout.swizzle: calls.append(1) or f(d)))
    assert kernels.load(model, iter(second.items()), prepared) == [] and calls == []  # only copied
    assert kernels.load(plain, iter(second.items())) == [] and calls
    for i in range(2):
        for proj in ("w13", "w2"):
            for part in ("value", "scale"):
                assert torch.equal(held(model, i, proj, part), held(plain, i, proj, part))
    files = fp.files_fingerprint(second.items(), torch.bfloat16, widened_biases=True)
    assert fp.total(fp.model_fingerprints(model).values()) == files  # the load's proof holds
    wrong = {n: t[..., :-1] for n, t in prepared.items()}  # made for another layout: refused, said, not written
    refused = kernels.load(model, iter(second.items()), wrong)
    assert len(refused) == 8 and all("prepared" in r for r in refused), refused


def test_the_worker_stages_mxfp4_experts_ready_for_their_kernels_and_the_swap_copies_them(tmp_path, worker,
                                                                                          monkeypatch):
    for v in (1, 2):
        (tmp_path / f"v{v}").mkdir()
        save_file({k: t.contiguous() for k, t in version(v).items()}, tmp_path / f"v{v}" / "model.safetensors")
    assert worker._offpolicy_inplace_refused() is None and worker._offpolicy_kernels  # as the server's baseline did
    worker.offpolicy_prefetch(str(tmp_path / "v1"), "device")
    worker._offpolicy_ahead.result(str(tmp_path / "v1"))  # staged and prepared in the background
    calls = []
    monkeypatch.setattr(ValueLayout, "swizzle", staticmethod(lambda d, f=ValueLayout.swizzle: calls.append(1) or f(d)))
    r = json.loads(worker.offpolicy_load(str(tmp_path / "v1"), "inplace", "device"))
    assert calls == []  # the swap swizzled nothing
    assert r["method"] == "inplace" and r["kernels"] and r["staged"]["ahead"]
    assert r["staged"]["prepared"] == 8 and r["staged"]["prepared_bytes"] == kernels.prepared_bytes(
        worker.model_runner.get_model()) and r["staged"]["prepare_seconds"] > 0
    files = fp.files_fingerprint(version(1).items(), torch.bfloat16, widened_biases=True)
    assert int(r["files"]) == files and fp.total(int(t) for t in r["tensors"].values()) == files  # proven
    assert worker._offpolicy_ahead.result(str(tmp_path / "v1")).value.prepared == {}  # let go after the load
    r = json.loads(worker.offpolicy_load(str(tmp_path / "v2"), "inplace", "hash"))  # nothing staged: swizzled now
    assert calls and r["method"] == "inplace" and "staged" not in r and int(r["files"]) == fp.files_fingerprint(
        version(2).items(), torch.bfloat16, widened_biases=True)
