"""What offpolicy runs inside SGLang's TP workers: the fingerprints of the model they hold and of a version's files.

SGLang 0.5.14 lets a server's launch name functions it may call as weight loaders (`ServerArgs.custom_weight_loader`,
a list of import paths, `server_args.py:2318-2324`); `update_weights_from_tensor(named_tensors, load_format=<one of
them>)` then makes every TP worker call `dynamic_import(load_format)(model, named_tensors)` with its own model
(`model_executor/model_runner.py:2066-2094`, from `managers/tp_worker.py:165-173`). `offpolicy_fingerprint` is such a
loader, registered by the engine (`LOADER`; docs/sglang.md, "The proof of a load"), that loads nothing:
- its one named tensor is empty; the tensor's name is the request (`request` builds it, `parse` reads it): the
  directory to write the report in and the version's files to hash (or none);
- each worker writes `rank<r>.json` there (`report`): the fingerprint of every tensor its model holds
  (`fingerprint.model_fingerprints`, by SGLang's names), and its share of the files' fingerprint, by module group
  (`group_of`; the tensors whose crc32(name) % world == rank, read by safetensors onto the model's device and cast as
  the model holds them, `as_held`, with that cast, `Cast`; a hub id read where the Hugging Face cache holds it,
  `local_dir`), with its rank, the world size and the seconds each took; the same share by module group and tensor
  kind (`kind_key`: `files_kinds`, which say which kinds of a group a failed proof's difference lies in);
- it writes no parameter: it only reads them (under `torch.inference_mode`), and what it hashes of the files are
  tensors of its own;
- an exception is caught and written as the report's `error`: nothing catches one between SGLang's scheduler loop and
  a weight loader (`managers/scheduler.py:1641`, `scheduler_components/weight_updater.py:147-160`), so it would end
  the scheduler; what the loader returns SGLang drops (model_runner.py:2088-2090 answers (True, "Success")).
Imports torch and the fingerprint, nothing of SGLang: tested on CPU with stand-in models in SGLang's layouts.
"""

from __future__ import annotations

import json
import logging
import re
import time
import traceback
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from offpolicy.plumbing.files import write_atomic
from offpolicy.rollout.engines import fingerprint as fp

log = logging.getLogger("offpolicy.sglang")

LOADER = "offpolicy.rollout.engines.sglang.worker.offpolicy_fingerprint"  # the import path SGLang is given
SYNCED_LOADER = "offpolicy.rollout.engines.sglang.worker.offpolicy_load_synced"  # direct loads' (below)
KIND = "offpolicy-fingerprint"  # what a request's name says it is
_LAYER = re.compile(r"^(.*?\blayers\.\d+\.[^.]+)\.")


def group_of(name: str) -> str:
    """The module group a tensor belongs to, in the checkpoint's names and SGLang's alike: `<...>.layers.<i>.<module>`
    inside a layer (`model.layers.3.self_attn`, `model.layers.3.mlp`: what SGLang fuses, q/k/v into qkv_proj, gate and
    up into gate_up_proj, the experts into w13 / w2, stays inside its module), else the name without its last part
    (`model.embed_tokens`, `lm_head`, `model.norm`)."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0] or name


def kind_of(name: str) -> str:
    """A tensor's kind: its name's last part (`weight`, `weight_scale_inv`, `bias`, `sinks`, `w13_weight`). SGLang's
    fused tensors keep the kind of those they fuse (`qkv_proj.weight_scale_inv` of `q_proj.weight_scale_inv`, ...);
    its experts do not (`w13_weight` of `gate_up_proj`)."""
    return name.rpartition(".")[2]


KIND_SEP = "|"  # between the group and the kind of a `kind_key`: in no tensor's name


def kind_key(name: str) -> str:
    """`<group>|<kind>` of a tensor (`group_of`, `kind_of`): what the files' fingerprint is summed by
    (`files_totals`)."""
    return f"{group_of(name)}{KIND_SEP}{kind_of(name)}"


def by_group(kinds: dict[str, int]) -> dict[str, int]:
    """Fingerprints by `kind_key` summed by group (a key without KIND_SEP is a group's already)."""
    return fp.totals((k.partition(KIND_SEP)[0], v) for k, v in kinds.items())


def request(report_dir: str, files: str | None) -> str:
    """The name of the empty tensor that asks every worker for its report in `report_dir` (and to hash its share of
    the safetensors files at `files`)."""
    return json.dumps({"kind": KIND, "report": str(report_dir), "files": None if files is None else str(files)})


def parse(name: str) -> dict | None:
    """The request a tensor's name holds, or None when it is not one of ours."""
    try:
        req = json.loads(name)
    except ValueError:
        return None
    return req if isinstance(req, dict) and req.get("kind") == KIND and isinstance(req.get("report"), str) else None


def rank_world() -> tuple[int, int]:
    """This worker's rank and the world's size (SGLang's TP ranks: world = tp_size with one pipeline stage)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def model_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The dtype most of the model's 16- and 32-bit floating elements have (what SGLang built the model in: a
    quantized model's packed experts and fp8 weights are narrower, its float32 expert biases few)."""
    count: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point() and t.element_size() >= 2:
            count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    return max(count, key=count.__getitem__) if count else None


def as_held(name: str, t: torch.Tensor, dtype: torch.dtype | None, widened: bool,
            held: dict[str, torch.dtype]) -> torch.Tensor:
    """A file tensor as the model holds it: in the dtype of the model's tensor of the same name where there is one
    of 16 or 32 bits (GPT-OSS's sinks are float32 on SGLang's trtllm_mha backend, `models/gpt_oss.py:391-397`), else
    as `fingerprint.as_held` casts it (the model's dtype; the experts' biases float32 where the model widens them,
    `layers/quantization/unquant.py:210-237`)."""
    own = held.get(name)
    if (own is not None and own.is_floating_point and own.itemsize >= 2 and t.is_floating_point()
            and t.element_size() > 1 and not name.endswith(fp.KEPT_AS_STORED)):
        return t.to(own)
    return fp.as_held(name, t, dtype, widened)


def replicated_kv(model: torch.nn.Module) -> bool:
    """Whether a fused qkv_proj repeats KV heads on several TP ranks (tp_size > num_key_value_heads: SGLang's
    QKVParallelLinear `num_kv_head_replicas`): those rows are counted once in the files and several times here."""
    return any(int(getattr(m, "num_kv_head_replicas", 1) or 1) > 1 for m in model.modules())


def local_dir(path: str) -> str:
    """`path`, or where the Hugging Face cache holds the model of that hub id (as SGLang started on it), if it does."""
    if Path(path).is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
    except (ImportError, OSError, ValueError):  # not a hub id (ValueError), not in the cache (OSError): no files
        return path


@dataclass(frozen=True)
class Cast:
    """How a model holds the tensors of its checkpoint (`as_held`): its dtype, whether it widens the experts' biases,
    and the dtype of each tensor it owns by name. A worker reports it with the files' fingerprint (`report`), so that
    the daemon can fingerprint a version's files as the workers would (`files_totals`, ahead of the load)."""

    dtype: torch.dtype | None
    widened: bool
    held: dict[str, torch.dtype]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Cast:
        owned = dict(fp.module_tensors(model))
        dtype = model_dtype(owned.values())
        return cls(dtype, fp.widened_expert_biases(model, dtype), {n: t.dtype for n, t in owned.items()})

    def to_json(self) -> dict:
        return {"dtype": _dtype_name(self.dtype), "widened": self.widened,
                "held": {n: _dtype_name(d) for n, d in self.held.items()}}

    @classmethod
    def from_json(cls, reports: list[dict]) -> Cast | None:
        """The cast the workers' reports give (their tensors' dtypes together), or None where one gives none."""
        casts = [r.get("cast") for r in reports]
        if not casts or any(c is None for c in casts):
            return None
        held = {n: _dtype(d) for c in casts for n, d in c["held"].items()}
        return cls(_dtype(casts[0]["dtype"]), bool(casts[0]["widened"]), held)


def _dtype_name(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def files_totals(tensors: Iterable[tuple[str, torch.Tensor]], cast: Cast) -> tuple[dict[str, int], int]:
    """The fingerprint of checkpoint tensors as a model of `cast` holds them, by module group and tensor kind
    (`kind_key`; `by_group` sums them by group), and how many there were."""
    parts = [(kind_key(name), fp.tensor_fingerprint(as_held(name, t, cast.dtype, cast.widened, cast.held)))
             for name, t in tensors]
    return fp.totals(parts), len(parts)


def report(model: torch.nn.Module, files: str | None, rank: int, world: int) -> dict:
    """This worker's report (the module docstring)."""
    t0 = time.perf_counter()
    tensors = fp.model_fingerprints(model)
    t1 = time.perf_counter()
    out: dict = {"rank": rank, "world": world, "tensors": {k: str(v) for k, v in tensors.items()},
                 "replicated_kv": replicated_kv(model), "hash_model_seconds": t1 - t0}
    if files is not None:
        cast = Cast.of(model)
        device = next((str(t.device) for _, t in fp.module_tensors(model)), "cpu")
        mine = (lambda n: zlib.crc32(n.encode()) % world == rank)
        kinds, count = files_totals(fp.checkpoint_tensors(local_dir(files), device, mine), cast)
        out.update(files={k: str(v) for k, v in by_group(kinds).items()},
                   files_kinds={k: str(v) for k, v in kinds.items()}, files_tensors=count, cast=cast.to_json(),
                   hash_files_seconds=time.perf_counter() - t1)
    return out


def offpolicy_fingerprint(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom weight loader call (the module docstring): write this worker's report for every request among
    `named_tensors`; never raise."""
    for name, _ in named_tensors:
        req = parse(name) if isinstance(name, str) else None
        if req is None:
            log.error("offpolicy's fingerprint loader was sent %r, not a request of its own: nothing loaded", name)
            continue
        rank, world = 0, 1
        try:
            rank, world = rank_world()
            with torch.inference_mode():
                answer = report(model, req.get("files"), rank, world)
        except Exception as e:  # any: one raised here would end SGLang's scheduler (the module docstring)
            answer = {"rank": rank, "world": world, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc(limit=8)}
        _write(Path(req["report"]) / f"rank{rank}.json", answer)


def _write(path: Path, answer: dict) -> None:
    """Write the report whole (a temporary file renamed into place), or log why not."""
    try:
        write_atomic(path, json.dumps(answer))
    except OSError as e:
        log.error("offpolicy's fingerprint loader could not write its report %s: %s", path, e)


def offpolicy_load_synced(model, named_tensors) -> None:
    """A weight loader (registered beside LOADER) that loads `named_tensors` with the model's own `load_weights`, as
    SGLang's default (`load_format` None) does, then waits for its copies on the worker's GPU. SGLang answers a tensor
    update once its loaders have returned (no GPU sync on the way, 0.5.14 `weight_updater.py:147-160`), while their
    copies may still read the sender's memory, which a direct load frees for its next window
    (`staged.direct_requests`); after this loader the answer means the copies are done."""
    named = list(named_tensors)
    model.load_weights(named)
    copied(named)


def copied(named: list) -> None:
    """Wait for the copies out of `named`'s tensors on their GPUs (what a synced loader's answer then means)."""
    for device in {t.device for _, t in named if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
