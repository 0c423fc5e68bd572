"""Proof that an SGLang engine or server holds a weight version, by SGLang's own read-back `get_weights_by_name`.

After each load (an `update_weights_from_disk`, or a start of `sglang.Engine` on the version) a few tensors that
SGLang keeps unfused, under their HF names, are read back and compared, exactly, with the version's own files:
- `expect(path, version)` picks them from the version's safetensors files (`sample_names`): `model.norm.weight`,
  `model.embed_tokens.weight` and `lm_head.weight`, and of the first, middle and last layers `input_layernorm.weight`,
  `post_attention_layernorm.weight` and the linear `self_attn.o_proj.weight`; only tensors stored unquantized
  (16- or 32-bit floats: an fp8 weight is 1 byte, an MXFP4 expert is packed bytes) and of at most `MAX_ELEMENTS`
  elements, because SGLang turns the whole parameter into a Python list before it truncates (0.5.14
  `models/llama.py:767`); of each, the first `rows` entries of its first dimension (SGLang's `truncate_size`
  slices the list of rows), at most `READ_VALUES` values;
- `prove(expected, read, state, where)` reads them back (`read(name, rows)`: the parameter's values as nested lists,
  or None where SGLang answered none) and compares each value exactly as float64 (16- and 32-bit floats widen
  exactly; a float32 file tensor also matches its bfloat16 or float16 rounding, an engine that keeps the model in 16
  bits). A load is proven when every tensor read back matches and at least one of them differs from the previous
  version this engine held (or there was none): a match that cannot tell the version from the one before proves
  nothing. A tensor that differs raises `WeightUpdateError` naming it (and whether it still holds the previous
  version's values); the caller then takes the engine or server out of service until a load succeeds.
- SGLang implements `get_weights_by_name` per model class, and few have one: the Llama family, OPT, Granite, EXAONE 4
  (0.5.14 `model_executor/model_runner.py:2129-2144` calls the model's own and answers None when it has none; GPT-OSS
  and Qwen2/Qwen3 have none): an engine that answers None for every tensor is unreadable, its loads are recorded
  unproven (with why) and it is not asked again; one that answered before and then answers nothing fails the load.
- A version whose files cannot be read raises `VersionRefused` before anything is loaded.
- `by_mode` picks the proof of a load by `rollout.sglang.proof`: this read-back, the fingerprint of every tensor
  (`fingerprint_proof.py`, where SGLang has no read-back), or, auto, the read-back where the model answers it.
- Not checked: fused tensors (qkv, gate/up, MoE experts) and quantized ones. With TP, SGLang answers rank 0's
  parameter: whole for the norms (replicated) and o_proj (gathered, llama.py:763-766), the first rows of the
  vocabulary for the embedding and lm_head (their shard on rank 0: `rows_of` asks for no more than it holds).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from offpolicy.rollout.engines.errors import VersionRefused, WeightUpdateError
from offpolicy.weights import WeightVersion

log = logging.getLogger("offpolicy.sglang")

MODEL_TENSORS = ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight")
LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight")
LAYER_LINEAR = ("self_attn.o_proj.weight",)  # left out where the engine quantizes the model itself (`linear`)
MAX_ELEMENTS = 1 << 21  # SGLang lists the whole parameter in Python floats on every TP rank before truncating
READ_VALUES = 1 << 14  # values read back of one tensor at most
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
VOCAB_SHARDS = 16
NO_READ_BACK = "this SGLang model has no get_weights_by_name (few have one: the Llama family's, docs/sglang.md)"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Sample:
    name: str
    rows: int  # SGLang's truncate_size: entries of the first dimension read back
    values: torch.Tensor  # the version's first `rows` entries, as stored in its files
    linear: bool = False  # a linear layer's weight (left out where the engine quantizes online)


@dataclass(frozen=True)
class Expected:
    version: int
    path: str
    samples: list[Sample] = field(default_factory=list)

    def of(self, name: str) -> Sample | None:
        return next((s for s in self.samples if s.name == name), None)


def unquantized(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() >= 2


def sample_names(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, bool]]:
    """(name, linear) of the tensors to read back: the known unfused names present in the version, unquantized and
    small enough (the module docstring), of the first, middle and last layers."""
    layers = sorted({int(m.group(1)) for n in tensors for m in [_LAYER.match(n)] if m})
    picked = sorted({layers[0], layers[len(layers) // 2], layers[-1]}) if layers else []
    wanted = [(n, False) for n in MODEL_TENSORS]
    for i in picked:
        wanted += [(f"model.layers.{i}.{n}", False) for n in LAYER_TENSORS]
        wanted += [(f"model.layers.{i}.{n}", True) for n in LAYER_LINEAR]
    return [(n, linear) for n, linear in wanted
            if n in tensors and unquantized(tensors[n]) and 0 < tensors[n].numel() <= MAX_ELEMENTS]


def rows_of(name: str, shape: tuple[int, ...]) -> int:
    """The truncate_size that reads at most READ_VALUES values (at least one row) of tensor `name` of `shape`; of the
    vocabulary-parallel ones (embed_tokens, lm_head: SGLang answers TP rank 0's shard of the rows, padded) at most
    1/VOCAB_SHARDS of the rows, which rank 0 holds real under any TP up to VOCAB_SHARDS."""
    width = 1
    for d in shape[1:]:
        width *= d
    rows = min(shape[0], READ_VALUES // max(1, width))
    if name in VOCAB_PARALLEL:
        rows = min(rows, shape[0] // VOCAB_SHARDS)
    return max(1, rows)


def expect(path: str, version: int) -> Expected:
    """What the engine must read back after loading the version at `path` (a copy: the files may be reused later).
    Raises VersionRefused where the version's files cannot be read: nothing was loaded, the engine's version stays."""
    try:
        with WeightVersion(path) as wv:
            tensors = wv.tensors
            samples = []
            for name, linear in sample_names(tensors):
                t = tensors[name]
                rows = rows_of(name, tuple(t.shape))
                samples.append(Sample(name, rows, t[:rows].clone(), linear))
    except (OSError, ValueError) as e:
        raise VersionRefused(f"weight version {version} at {path} cannot be read ({type(e).__name__}: {e}); it was not "
                             "loaded, the engine keeps the version it holds") from None
    return Expected(version, str(path), samples)


def _replicas(answer: Any, ndim: int) -> list[Any]:
    """SGLang's answer as one parameter per data-parallel rank: with dp_size > 1 the tokenizer manager answers a list
    of them (0.5.14 `managers/tokenizer_control_mixin.py:735-739`), one level deeper than the tensor."""
    depth, x = 0, answer
    while isinstance(x, list) and x:
        depth, x = depth + 1, x[0]
    return answer if depth == ndim + 1 else [answer]


def mismatch(sample: Sample, answer: Any) -> str:
    """Why SGLang's answer is not the sample's values ("" when it is)."""
    want = [sample.values.double()]
    if sample.values.dtype == torch.float32:  # an engine that keeps the model in 16 bits rounds a float32 file
        want += [sample.values.to(torch.bfloat16).double(), sample.values.to(torch.float16).double()]
    for got in _replicas(answer, sample.values.dim()):
        try:
            have = torch.tensor(got, dtype=torch.float64)
        except (TypeError, ValueError):
            return f"answered {str(got)[:80]}, not a tensor of shape {tuple(sample.values.shape)}"
        if tuple(have.shape) != tuple(sample.values.shape):
            return (f"answered shape {tuple(have.shape)}, the version's first {sample.rows} rows are "
                    f"{tuple(sample.values.shape)}")
        if not any(torch.equal(have, w) for w in want):
            i = int((have != want[0]).flatten().nonzero()[0])
            return (f"differs from the version's file at element {i} of the first {sample.rows} rows "
                    f"({have.flatten()[i].item()!r}, the file {want[0].flatten()[i].item()!r})")
    return ""


def prove(expected: Expected, read: Callable[[str, int], Any], state: dict, where: str,
          linear: bool = True) -> dict:
    """Read `expected`'s tensors back through `read(name, rows)` and compare them (the module docstring); `state` is
    the engine's or server's own across loads ("previous": the Expected of the version it holds, "readable": whether
    its model answers get_weights_by_name). Returns the load's record (`verified`, `tensors` read back, `changed`,
    `proof_seconds`, `why` when not verified); raises WeightUpdateError when a tensor differs."""
    t0 = time.perf_counter()
    previous: Expected | None = state.get("previous")
    samples = [s for s in expected.samples if linear or not s.linear]
    record: dict[str, Any] = {"verified": False, "tensors": [], "changed": []}

    def unproven(why: str) -> dict:
        state["previous"] = expected
        return {**record, "why": why, "proof_seconds": time.perf_counter() - t0}

    if not samples:
        return unproven("the version has none of the tensors SGLang reads back unfused and unquantized "
                        f"({', '.join(MODEL_TENSORS + LAYER_TENSORS)})")
    if state.get("readable") is False:
        return unproven(NO_READ_BACK)
    answers = {s.name: read(s.name, s.rows) for s in samples}
    read_back = [s for s in samples if answers[s.name] is not None]
    if not read_back:
        if state.get("readable"):
            state["previous"] = None
            raise WeightUpdateError(f"{where}: after loading weight version {expected.version} from {expected.path}, "
                                    "get_weights_by_name answered nothing for any of "
                                    f"{', '.join(s.name for s in samples)}, which it read back before: the load cannot "
                                    "be proven; look at the SGLang log")
        state["readable"] = False
        log.warning("%s: get_weights_by_name answers nothing for %s: SGLang's model class has no read-back (few have "
                    "one: the Llama family's, docs/sglang.md), so its weight loads are recorded unproven", where,
                    ", ".join(s.name for s in samples))
        return unproven(NO_READ_BACK)
    state["readable"] = True
    wrong = []
    for s in read_back:
        why = mismatch(s, answers[s.name])
        if why:
            before = previous.of(s.name) if previous is not None else None
            stale = before is not None and before.rows == s.rows and not mismatch(before, answers[s.name])
            wrong.append(f"{s.name} {why}" + (f" (it still holds version {previous.version}'s values)"
                                              if stale else ""))
    if wrong:
        state["previous"] = None
        raise WeightUpdateError(f"{where}: after loading weight version {expected.version} from {expected.path} the "
                                f"tensors SGLang reads back are not the version's: {'; '.join(wrong)}; it generates no "
                                "more until a load succeeds (docs/sglang.md, 'The proof of a load')")
    record["tensors"] = [s.name for s in read_back]
    record["changed"] = [s.name for s in read_back if previous is None or _changed(s, previous.of(s.name))]
    state["previous"] = expected
    record["proof_seconds"] = time.perf_counter() - t0
    if previous is not None and not record["changed"]:
        return {**record, "why": f"the tensors read back hold the same values in version {previous.version}: the "
                                 "read-back cannot tell this load from none"}
    return {**record, "verified": True}


def by_mode(mode: str, read_back: Callable[[], dict], state: dict, fingerprint: Callable[[], dict]) -> dict:
    """The load's record by the proof `mode` picks (rollout.sglang.proof: "read_back", "fingerprint", or "auto": the
    read-back where the model answers it, `state` the read-back's own, else the fingerprint); each record says which
    proof it is (`proof`), and an unproven one of auto why neither proved it."""
    if mode == "fingerprint":
        return fingerprint()
    why = NO_READ_BACK
    if mode == "read_back" or state.get("readable") is not False:
        record = {**read_back(), "proof": "read_back"}
        if mode == "read_back" or state.get("readable"):
            return record
        why = record.get("why", why)  # no read-back, or nothing of the version it could read
    record = fingerprint()
    return record if record["verified"] else {**record, "why": f"{why}; by fingerprint: {record.get('why')}"}


def _changed(now: Sample, before: Sample | None) -> bool:
    return before is None or not torch.equal(now.values, before.values)
