"""Stand-ins for the models SGLang 0.5.14 builds, and for its call of a custom weight loader, for the tests of the
fingerprint proof (offpolicy/rollout/engines/sglang/worker.py, fingerprint_proof.py). No SGLang here.

`SGLangModel(path, tp_rank, tp_size, dtype)` holds an HF checkpoint's tensors as SGLang's model class holds them on
one TP rank (`layout`), as parameters and buffers of nested modules, under SGLang's names:
- Llama (`models/llama.py`): q/k/v stacked into `qkv_proj`, gate and up into `gate_up_proj` (each the rank's rows),
  o_proj / down_proj the rank's columns, norms whole on every rank;
- GPT-OSS (`models/gpt_oss.py` with the triton_kernels MoE SGLang picks for bf16 on Hopper, `server_args.py:3913-3935`):
  `qkv_proj` weight and bias, o_proj's weight the rank's columns and its bias whole, `sinks` the rank's heads
  (`gpt_oss.py:1229-1250`), the router whole; experts `w13_weight` [E, H, 2I/tp] (HF's gate_up_proj, gate and up
  still interleaved, the rank's columns: `layers/moe/fused_moe_triton/layer.py:441-503`, transposed twice),
  `w13_weight_bias` float32 [E, 2I/tp], `w2_weight` [E, I/tp, H], `w2_weight_bias` float32 [E, H], zeros on every
  rank but the first (`gpt_oss.py:1195-1196`; `layers/quantization/unquant.py:182-237`); `pad` > 0 widens each expert's
  intermediate columns with a constant the loads never write (what a backend that rounds the size up leaves);
- both: the embedding and lm_head vocabulary-parallel, padded to 64 rows with zeros
  (`layers/vocab_parallel_embedding.py:444-493`), a rotary `cos_sin_cache` buffer per layer;
- an fp8 checkpoint (block-quantized attention, `weights/fp8.py`) on one rank: its `weight_scale_inv` fused into
  `qkv_proj` as its weights are, fp8 values and float32 scales as stored (`_held`);
- any other checkpoint (an MXFP4 one), and any tensor of these not named above: as it is.
`load(path, stale_from=None, stale=())` copies a checkpoint into the model's own tensors as update_weights_from_disk
does, the HF tensors named in `stale` taken from `stale_from` instead (a load that missed them).
`run_loader(loaders, payloads, load_format, models)` is SGLang's update_weights_from_tensor with a custom loader: the
loader refused unless registered, each rank's payload unpickled as SGLang's SafeUnpickler would (torch classes only),
then `fn(model, named_tensors)` called on each rank's model, with that rank as the worker's (`models_of`);
`TensorUpdates` gives an in-process stand-in sglang.Engine that method, `install` puts one in sglang's place.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import pickle
import re
import threading
import types
from pathlib import Path

import torch

from offpolicy.rollout.engines.fingerprint import checkpoint_tensors
from offpolicy.rollout.engines.sglang import worker

VOCAB_PAD = 64


def checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of an HF directory."""
    config = json.loads((Path(path) / "config.json").read_text())
    return config, dict(checkpoint_tensors(path, "cpu"))


def _part(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim)[rank]


def _vocab(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = -(-t.shape[0] // VOCAB_PAD) * VOCAB_PAD // size
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    mine = t[rank * rows:(rank + 1) * rows]
    out[:mine.shape[0]] = mine
    return out


def layout(config: dict, tensors: dict[str, torch.Tensor], rank: int, size: int, pad: int = 0,
           pad_value: float = 7.0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as SGLang's model class holds them on TP rank `rank` of `size` (module docstring),
    in the checkpoint's dtypes (the expert biases float32)."""
    kind = config.get("model_type")
    if kind not in ("llama", "gpt_oss") or any(n.endswith("_blocks") for n in tensors):
        return dict(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab(t, rank, size)
        elif name.endswith(("layernorm.weight", "model.norm.weight", "o_proj.bias", "router.weight", "router.bias")):
            out[name] = t
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = _part(t, 1, rank, size)
        elif name.endswith("self_attn.sinks"):
            out[name] = _part(t, 0, rank, size)
    layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")})
    for i in layers:
        pre = f"model.layers.{i}"
        for suffix in ("weight", "bias", "weight_scale_inv"):
            qkv = [tensors.get(f"{pre}.self_attn.{p}_proj.{suffix}") for p in "qkv"]
            if all(x is not None for x in qkv):
                out[f"{pre}.self_attn.qkv_proj.{suffix}"] = torch.cat([_part(x, 0, rank, size) for x in qkv])
        out[f"{pre}.self_attn.rotary_emb.cos_sin_cache"] = torch.linspace(-1, 1, 64)
        if kind == "llama":
            gate, up = tensors[f"{pre}.mlp.gate_proj.weight"], tensors[f"{pre}.mlp.up_proj.weight"]
            out[f"{pre}.mlp.gate_up_proj.weight"] = torch.cat([_part(gate, 0, rank, size), _part(up, 0, rank, size)])
            continue
        e = f"{pre}.mlp.experts"
        w13 = _part(tensors[f"{e}.gate_up_proj"], 2, rank, size)  # [E, H, 2I/tp], gate and up interleaved
        w2 = _part(tensors[f"{e}.down_proj"], 1, rank, size)  # [E, I/tp, H]
        if pad:
            w13 = torch.cat([w13, torch.full((*w13.shape[:2], 2 * pad), pad_value, dtype=w13.dtype)], 2)
            w2 = torch.cat([w2, torch.full((w2.shape[0], pad, w2.shape[2]), pad_value, dtype=w2.dtype)], 1)
        out[f"{e}.w13_weight"], out[f"{e}.w2_weight"] = w13, w2
        out[f"{e}.w13_weight_bias"] = _part(tensors[f"{e}.gate_up_proj_bias"], 1, rank, size).float()
        down_bias = tensors[f"{e}.down_proj_bias"].float()
        out[f"{e}.w2_weight_bias"] = down_bias if rank == 0 else torch.zeros_like(down_bias)
    known = re.compile(r"(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj|mlp\.experts)\.")
    return {**{n: t for n, t in tensors.items() if n not in out and not known.search(n)}, **out}  # the rest as is


class SGLangModel(torch.nn.Module):
    """A checkpoint in SGLang's layout on one TP rank (module docstring): parameters, and the rotary tables as
    buffers, of nested modules named as SGLang's."""

    def __init__(self, path: str, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype | None = None, pad: int = 0,
                 sinks_dtype: torch.dtype | None = None):
        super().__init__()
        self.where, self.dtype_, self.pad, self.sinks_dtype = (tp_rank, tp_size), dtype, pad, sinks_dtype
        config, tensors = checkpoint(path)
        for name, t in self._held(config, tensors).items():
            *mods, leaf = name.split(".")
            owner: torch.nn.Module = self
            for m in mods:
                if m not in owner._modules:
                    owner.add_module(m, torch.nn.Module())
                owner = owner._modules[m]
            if "cache" in leaf:
                owner.register_buffer(leaf, t)
            else:
                owner.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))

    def _held(self, config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        held = layout(config, tensors, *self.where, pad=self.pad)
        for name, t in held.items():
            if not t.is_floating_point() or t.element_size() == 1 or "cache" in name or name.endswith("_scale_inv"):
                continue
            if name.endswith("self_attn.sinks") and self.sinks_dtype is not None:
                held[name] = t.to(self.sinks_dtype)
            elif ".experts." in name and name.endswith("_bias"):
                held[name] = t.float()
            elif self.dtype_ is not None:
                held[name] = t.to(self.dtype_)
        return held

    def load(self, path: str, stale_from: str | None = None, stale: tuple[str, ...] = ()) -> None:
        """update_weights_from_disk: the checkpoint at `path` copied into the model's own tensors (module docstring)."""
        config, tensors = checkpoint(path)
        if stale:
            old = checkpoint(str(stale_from))[1]
            tensors.update({n: old[n] for n in stale})
        held = self._held(config, tensors)
        with torch.no_grad():
            for name, t in self.named_parameters():
                if "cache" not in name:
                    t.copy_(held[name])


def payload(named_tensors: list) -> str:
    """What SGLang's Engine sends each TP worker (MultiprocessingSerializer.serialize, base64 as over HTTP)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode()


class TorchOnly(pickle.Unpickler):
    """SGLang's SafeUnpickler narrowed to torch's classes (0.5.14 `utils/common.py:2381-2452` allows these among
    others): what the request needs, and all it may need."""

    def find_class(self, module: str, name: str):
        if not (module + ".").startswith("torch."):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def models_of(path: str, tp_size: int = 1, dtype: torch.dtype | None = None, stale_from: str | None = None,
              stale: tuple[str, ...] = ()) -> list[torch.nn.Module]:
    """The TP ranks' models of a stand-in that holds the checkpoint at `path` (`stale`: HF tensors it still holds
    from `stale_from`); an empty model where `path` is no checkpoint (a stand-in launched on a made-up path)."""
    if not (Path(path) / "config.json").is_file():
        return [torch.nn.Module() for _ in range(tp_size)]
    models = [SGLangModel(path, r, tp_size, dtype) for r in range(tp_size)]
    if stale:
        for m in models:
            m.load(path, stale_from, stale)
    return models


_RANKS = threading.local()  # run_loader's (rank, world) for the loader it runs, in its own thread only
_rank_world = worker.rank_world


def _thread_rank_world() -> tuple[int, int]:
    """worker.rank_world as each TP rank's loader sees it in `run_loader` (a thread-local: a loader that another
    thread runs meanwhile, a test's engine still loading, must not see it), else the real one."""
    ranks = getattr(_RANKS, "value", None)
    return ranks if ranks is not None else _rank_world()


worker.rank_world = _thread_rank_world  # a process-wide patch of the module leaked into other threads' loaders


def run_loader(loaders: list[str], payloads: list[str], load_format: str | None,
               models: list[torch.nn.Module]) -> None:
    """SGLang 0.5.14's update_weights_from_tensor on each TP rank's model, rank r reading `payloads[r]` (module
    docstring); raises what SGLang's scheduler would die of (an unknown load_format)."""
    if load_format not in loaders:
        raise NotImplementedError(f"Unknown load_format={load_format}")  # model_runner.py:2094
    module, _, attr = load_format.rpartition(".")
    fn = getattr(importlib.import_module(module), attr)
    for rank, model in enumerate(models):
        named = TorchOnly(io.BytesIO(base64.b64decode(payloads[rank]))).load()
        _RANKS.value = (rank, len(models))
        try:
            fn(model, [(n, t.to("cpu")) for n, t in named])
        finally:
            _RANKS.value = None


class TensorUpdates:
    """sglang.Engine.update_weights_from_tensor for the in-process stand-ins (0.5.14 `entrypoints/engine.py:1052-1074`:
    the named tensors pickled for each TP rank; `self.kwargs` its ServerArgs, `self.weights` the checkpoint it holds,
    `stale` the tensors it still holds from `stale_from`, `dtype` its parameters')."""

    kwargs: dict
    weights: str
    stale: tuple[str, ...] = ()
    stale_from: str | None = None
    dtype: torch.dtype | None = None

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        tp = int(self.kwargs.get("tp_size") or 1)
        return self.tensor_request(types.SimpleNamespace(serialized_named_tensors=[payload(named_tensors)] * tp,
                                                         load_format=load_format), None)

    def tensor_request(self, req, request):
        """Its tokenizer manager's update_weights_from_tensor (UpdateWeightsFromTensorReqInput: a pickle per TP rank)."""
        tp = int(self.kwargs.get("tp_size") or 1)
        run_loader(self.kwargs.get("custom_weight_loader") or [], list(req.serialized_named_tensors), req.load_format,
                   models_of(self.weights, tp, self.dtype, self.stale_from, self.stale))
        return True, "Success"


def noisy_versions(root: str, run: str, arch: dict, n: int, formats: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """{format: paths} of `n` versions of a tiny model of `arch` published natively (and in `formats`), each moved
    from the last by random noise (a constant step leaves a sharded bias with equal shards on every rank, which the
    fingerprint counts as a replica: fingerprint.combined)."""
    from offpolicy.config import WeightsConfig, load_config
    from offpolicy.models.build import build_model, hf_config, hf_state
    from offpolicy.weights import version_dir
    from offpolicy.weights.formats import store_run
    from offpolicy.weights.publisher import Publisher
    from tests.conftest import QUICKSTART

    torch.manual_seed(0)
    model = build_model(load_config(QUICKSTART, ["learner.device=cpu", "model.arch=" + json.dumps(arch)]).model,
                        torch.device("cpu"))
    store = Publisher(WeightsConfig(root=root, keep=10, formats=list(formats)), run)
    for v in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        store.publish(v, lambda: hf_state(model), hf_config(model))
    return {f: [str(version_dir(root, store_run(run, f), v)) for v in range(n)] for f in ("native", *formats)}


def install(monkeypatch, engine: type, fields: set[str]) -> None:
    """Make the in-process backend (offpolicy/rollout/engines/sglang/local.py) start `engine` as sglang.Engine, with
    SGLang's UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput and a ServerArgs of `fields`."""
    import sys
    import types

    from offpolicy.rollout.engines.sglang import local

    io_struct = types.SimpleNamespace(UpdateWeightFromDiskReqInput=lambda **kw: types.SimpleNamespace(**kw),
                                      UpdateWeightsFromTensorReqInput=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=engine))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setattr(local, "server_args_fields", lambda: fields)
