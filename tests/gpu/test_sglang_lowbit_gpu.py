"""SGLang's low-bit GPT-OSS versions, tensor by tensor: what its workers hold after a load (a test-only loader,
tests/gpu/sglang_dump.py, saves every tensor under a prefix and its fingerprint as held) against the version's files
(SGLang's fused `qkv_proj` against the files' q, k and v concatenated), printed. The diagnosis of the fingerprint
proofs that failed on the GPU (twenty-second session; found in the twenty-third): fp8 attention held in bf16, unscaled
(why fp8 GPT-OSS versions are refused for SGLang), and MXFP4 restarts whose kept scale Parameters counted twice. Needs
sglang and a CUDA GPU: `PYTHONPATH=.:/tmp/site:/tmp/ssite python3 -m pytest -s tests/gpu/test_sglang_lowbit_gpu.py`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from offpolicy.config import load_config
from offpolicy.rollout.engines import make_engine
from offpolicy.rollout.engines.errors import WeightUpdateError
from offpolicy.rollout.engines.fingerprint import checkpoint_tensors
from offpolicy.rollout.engines.sglang.fingerprint_proof import serialized
from offpolicy.weights import WeightStore
from tests.gpu.sglang_dump import LOADER
from tests.vllm_servers import ROOT, lowbit_version, perturbed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
              pytest.mark.timeout(900)]

GPTOSS = ROOT / "configs" / "gptoss-tiny.yaml"
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}


def dumped(engine, path: Path, prefix: str) -> dict[str, dict]:
    """Every tensor the engine's worker holds under `prefix` and its fingerprint as held (tests/gpu/sglang_dump.py),
    by SGLang's names: {"tensors": ..., "fingerprints": ...}."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    sgl = engine.backend.engine
    req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[serialized(json.dumps(
        {"dump": str(path), "prefix": prefix}))], load_format=LOADER, flush_cache=False)
    ok, message = sgl.loop.run_until_complete(sgl.tokenizer_manager.update_weights_from_tensor(req, None))
    assert ok, message
    return torch.load(f"{path}.rank0")


def files_counterpart(name: str, files: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The files' tensor SGLang's `name` holds: itself, or a fused one's parts concatenated along the output dim."""
    if name in files:
        return files[name]
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            got = [files.get(name.replace(fused, p)) for p in parts]
            return torch.cat(got) if all(g is not None for g in got) else None
    return None


def compared(held: dict[str, torch.Tensor], files: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None,
             group: str) -> list[str]:
    """A line per tensor of `group` the model holds: shapes, dtypes, elements whose bits differ from the files' (and
    from the previous version's files)."""
    lines = []
    for name in sorted(n for n in held if f".{group}." in n):
        h, f = held[name], files_counterpart(name, files)
        if f is None:
            lines.append(f"{name}: {tuple(h.shape)} {h.dtype}: no counterpart in the files")
            continue
        line = f"{name}: held {tuple(h.shape)} {h.dtype}, files {tuple(f.shape)} {f.dtype}"
        if h.shape != f.shape or h.element_size() != f.element_size():
            lines.append(line + ": shapes or widths differ")
            continue
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[h.element_size()]
        diff = (h.contiguous().view(bits) != f.contiguous().view(bits)).reshape(-1)
        line += f": {int(diff.sum())} of {diff.numel()} differ"
        if diff.any():
            first = int(diff.nonzero()[0])
            line += f" (first at {first}: held {h.reshape(-1)[first].item()}, files {f.reshape(-1)[first].item()})"
            prev = files_counterpart(name, old) if old else None
            if prev is not None and prev.shape == h.shape:
                same = int((h.contiguous().view(bits) == prev.contiguous().view(bits)).sum())
                line += f"; {same} equal the previous version's"
        lines.append(line)
    return lines


def lowbit_config(fmt: str, root: str, *more: str):
    return load_config(GPTOSS, ["model.arch.head_dim=64", "model.dtype=bfloat16", "rollout.engine=sglang",
                                f"weights.root={root}", "rollout.sglang.extra.disable_cuda_graph=true",
                                "rollout.sglang.mem_fraction_static=0.3", "rollout.sglang.attention_backend=triton",
                                f"weights.formats=[{fmt}]", f"rollout.weights_format={fmt}",
                                f"rollout.sglang.extra.custom_weight_loader=[{LOADER}]", *more])


def loaded(engine, wv) -> str:
    """Load `wv`: what the engine said (its record, or why it refused the version)."""
    try:
        engine.load(wv)
        return f"loaded: {engine.last_loads[-1]}"
    except WeightUpdateError as e:
        return f"refused: {e}"


def test_gptoss_fp8_attention_is_held_in_bf16(tmp_path, shm_root):
    """Why fp8 GPT-OSS versions are refused for SGLang (`weights.fp8_blocks.unserved`): 0.5.14 builds GPT-OSS's
    attention without the quantization config, so an engine started on an fp8 version holds `qkv_proj` / `o_proj` as
    bf16 parameters with the fp8 values copied in unscaled, and no `weight_scale_inv` (found on an H200, twenty-third
    session). When this fails, SGLang serves fp8 attention: lift the refusal and prove such loads."""
    from offpolicy.models.build import build_model

    cfg = lowbit_config("fp8", shm_root)
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(shm_root, "sgl-fp8-dump", keep=10, fmt="fp8")
    engine = make_engine(cfg, seed=1)
    try:
        perturbed(model, 1, 0.05)
        wv, _ = lowbit_version(store, 1, model, "fp8", (64, 64))  # the block `auto` gave before the refusal
        with wv:
            said = loaded(engine, wv)
            files = dict(checkpoint_tensors(str(wv.path), "cpu"))
        held = dumped(engine, tmp_path / "v1", "model.layers.")["tensors"]
    finally:
        engine.close()
    lines = compared(held, files, None, "self_attn")
    print(f"== version 1 {said}", *lines, sep="\n")
    attention = {n: t for n, t in held.items() if ".self_attn." in n}
    assert not any(n.endswith("weight_scale_inv") for n in attention), sorted(attention)
    weights = [attention[f"model.layers.{i}.self_attn.{m}.weight"] for i in (0, 1) for m in ("qkv_proj", "o_proj")]
    assert all(w.dtype == torch.bfloat16 for w in weights), [w.dtype for w in weights]
    q = files["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(held["model.layers.0.self_attn.qkv_proj.weight"][:q.shape[0]], q.to(torch.bfloat16))  # unscaled


# SGLang's MXFP4 expert tensors (on the triton_kernels MoE: the quant method's wrappers, unswizzled by the fingerprint)
# and the files' they are loaded from
MXFP4_PAIRS = {"w13_weight_triton_tensor.storage": "gate_up_proj_blocks", "w13_precision_config.weight_scale.storage":
               "gate_up_proj_scales", "w13_weight_bias": "gate_up_proj_bias",
               "w2_weight_triton_tensor.storage": "down_proj_blocks", "w2_precision_config.weight_scale.storage":
               "down_proj_scales", "w2_weight_bias": "down_proj_bias"}


def test_gptoss_mxfp4_restarts_hold_the_files_expert_tensors(tmp_path, shm_root):
    """Each MXFP4 version restarts the engine (local.py): per start, each expert tensor's fingerprint as the proof
    takes it against its files' (cast as held: the biases float32), and the mlp group's held-minus-files difference,
    which the proof takes as a constant offset from the first start: equal across starts, and each restart proven
    (before `fingerprint.kept_sources` the kept scale Parameters counted twice and every restart failed)."""
    from offpolicy.models.build import build_model
    from offpolicy.rollout.engines import fingerprint as fp

    cfg = lowbit_config("mxfp4", shm_root, "model.arch.hidden_size=256", "model.arch.intermediate_size=256")
    model = build_model(cfg.model, torch.device("cpu"))
    store = WeightStore(shm_root, "sgl-mxfp4-dump", keep=10, fmt="mxfp4")
    engine, report, offsets, proven = make_engine(cfg, seed=1), [], [], []
    group = "model.layers.0.mlp."
    try:
        for version in (1, 2, 3):
            perturbed(model, version, 0.05)
            wv, _ = lowbit_version(store, version, model, "mxfp4")
            with wv:
                said = loaded(engine, wv)
                files = {n: t for n, t in checkpoint_tensors(str(wv.path), "cuda") if n.startswith(group)}
            held = dumped(engine, tmp_path / f"v{version}", group)
            prints = {n: int(v) for n, v in held["fingerprints"].items()}
            kept = {n: fp.tensor_fingerprint(fp.as_held(n, t, torch.bfloat16, widened_biases=True))
                    for n, t in files.items()}  # as the model holds them: the experts' biases float32
            report.append(f"== version {version} {said}")
            report += [f"held {n}: {tuple(held['tensors'][n].shape)} {held['tensors'][n].dtype} fp {v}"
                       for n, v in sorted(prints.items())]
            report += [f"files {n}: {tuple(files[n].shape)} {files[n].dtype} fp {v}" for n, v in sorted(kept.items())]
            for h, f in MXFP4_PAIRS.items():
                hn = [n for n in prints if n.endswith(h)]
                fn = [n for n in kept if n.endswith(f)]
                same = len(hn) == len(fn) == 1 and prints[hn[0]] == kept[fn[0]]
                report.append(f"{h} against {f}: {'equal' if same else 'DIFFER'} ({hn} {fn})")
            offsets.append(fp.sub(fp.total(prints.values()), fp.total(kept.values())))
            report.append(f"mlp held - files: {offsets[-1]}")
            proven.append(version == 1 or said.startswith("loaded") and engine.last_loads[-1]["verified"])
    finally:
        engine.close()
    print("\n".join(report))
    assert len(set(offsets)) == 1, offsets
    assert all(proven), proven
