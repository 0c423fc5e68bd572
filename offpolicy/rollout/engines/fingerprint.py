"""Weight fingerprints: proof that an engine's parameters are a given weight version (vLLM's and SGLang's).

A fingerprint is a multiset hash of the bit patterns of every element of a set of tensors: each
non-zero element's bits (its own dtype's, zero-extended to 64 bits) go through the splitmix64 mixer,
and the results are summed mod 2^64 (an element equal to +0 or -0 counts nothing). Exact integer
arithmetic, so:
- it does not depend on order, shape or layout: an engine's fused QKV / gate-up parameters, interleaved
  or transposed experts, TP shards and zero padding of a version's tensors hash like the version's own files;
- any changed element changes it (a collision needs changes whose mixed values cancel mod 2^64).
An engine's parameters hold a version exactly when `engine = files(version) + offset`, where the
`offset` (constant buffers such as rotary tables, minus checkpoint tensors the engine does not keep)
is measured once per engine start, right after its own fresh load of its launch checkpoint. Tensors
whose name says cache (KV caches) are left out: they change with every request. Tensor-parallel
workers: a parameter of the same name with the same hash on every rank is replicated and counted
once; otherwise the ranks' shards are summed (`combine`). Torch (and on a GPU one Triton kernel,
`fingerprint_triton.py`), no vLLM or SGLang: tested on CPU
against a pure-Python reference. Used by vllm/worker.py (in vLLM's workers) and sglang/worker.py (in SGLang's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from offpolicy.rollout.engines import fingerprint_triton, hopper_value_hash

M = 1 << 64
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

Fingerprint = int  # in [0, 2^64)
ZERO: Fingerprint = 0


def _signed(c: int) -> int:
    return c - M if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix(bits: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors, wrapping mod 2^64 (torch integer products wrap)."""
    z = bits + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MUL1)
    z = (z ^ _shr(z, 27)) * _signed(_MUL2)
    return z ^ _shr(z, 31)


def mix_reference(b: int) -> int:
    """`mix` of one value in plain Python integers (the tests' independent reference)."""
    z = (b + _GOLDEN) % M
    z = ((z ^ (z >> 30)) * _MUL1) % M
    z = ((z ^ (z >> 27)) * _MUL2) % M
    return z ^ (z >> 31)


def tensor_fingerprint(t: torch.Tensor, chunk: int = 1 << 24) -> Fingerprint:
    """The multiset hash of one tensor's elements (float or byte dtypes, any device): on a GPU by one Triton kernel
    (`fingerprint_triton`, 1-, 2- and 4-byte elements); else `chunk` at a time, 1- and 2-byte elements by their bit
    patterns' histogram (`_histogram_fingerprint`), wider ones element by element."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or not (flat.is_floating_point() or flat.dtype in (torch.uint8, torch.int8)):
        return ZERO
    if fingerprint_triton.available(flat):  # one fused kernel on a GPU (fingerprint_triton.py)
        value = fingerprint_triton.fingerprint(flat, lambda sample: _torch_fingerprint(sample, chunk))
        if value is not None:
            return value
    return _torch_fingerprint(flat, chunk)


def _torch_fingerprint(flat: torch.Tensor, chunk: int) -> Fingerprint:
    """`tensor_fingerprint` of a flat float or byte tensor by torch alone."""
    if flat.element_size() <= 2:
        return _histogram_fingerprint(flat, chunk)
    return elementwise_fingerprint(flat, chunk)


def elementwise_fingerprint(flat: torch.Tensor, chunk: int = 1 << 24) -> Fingerprint:
    """`tensor_fingerprint` of a flat float or byte tensor by its definition, element by element: what wider elements
    take, and what `benchmarks/fingerprint_speed.py` times the histogram against."""
    size = flat.element_size()
    acc = 0
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].contiguous()
        bits = part.view(_INT_VIEW[size]).to(torch.int64)
        if size in _MASK:
            bits &= _MASK[size]
        h = torch.where(part != 0, mix(bits), 0)
        acc = (acc + int(h.sum().item())) % M
    return acc


_PATTERNS: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def _pattern_mixes(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """mix(v) of every bit pattern v of a 1- or 2-byte dtype (int64, indexed by v), 0 where the pattern's value
    equals zero (+0 and -0 of a float; 0 of an integer; a float8 `fnuz` dtype's 0x80 is NaN and counts)."""
    key = (dtype, str(device))
    if key not in _PATTERNS:
        n = 1 << (8 * torch.empty(0, dtype=dtype).element_size())
        patterns = torch.arange(n, dtype=torch.int64, device=device)
        values = patterns.to(torch.int32).to(_INT_VIEW[n.bit_length() // 8]).view(dtype)  # wraps to the signed view
        _PATTERNS[key] = torch.where(values != 0, mix(patterns), 0)
    return _PATTERNS[key]


def _histogram_fingerprint(flat: torch.Tensor, chunk: int) -> Fingerprint:
    """`tensor_fingerprint` of 1- or 2-byte elements: the count of each bit pattern (one `bincount` pass over the
    data) times that pattern's mix, summed: the same sum over elements, grouped by value, at a fraction of the
    element-wise mixing's memory traffic (an element is read once, not widened to 64 bits through ten kernels)."""
    size = flat.element_size()
    mixes = _pattern_mixes(flat.dtype, flat.device)
    counts = torch.zeros(1 << (8 * size), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        idx = part.view(torch.uint8) if size == 1 else part.view(torch.int16).to(torch.int32) & 0xFFFF
        counts += torch.bincount(idx, minlength=counts.numel())
    return int((counts * mixes).sum().item()) % M  # int64 products and sums wrap: exact mod 2^64


def add(x: Fingerprint, y: Fingerprint) -> Fingerprint:
    return (x + y) % M


def sub(x: Fingerprint, y: Fingerprint) -> Fingerprint:
    return (x - y) % M


def total(parts: Iterable[Fingerprint]) -> Fingerprint:
    acc = ZERO
    for p in parts:
        acc = add(acc, p)
    return acc


def totals(parts: Iterable[tuple[str, Fingerprint]]) -> dict[str, Fingerprint]:
    """The `total` of each key's parts ((key, fingerprint) pairs, e.g. by module group)."""
    acc: dict[str, Fingerprint] = {}
    for key, p in parts:
        acc[key] = add(acc.get(key, ZERO), p)
    return acc


def _held(obj: object) -> list[tuple[str, object]]:
    try:
        return list(vars(obj).items())
    except TypeError:  # no __dict__
        return []


def _storage(value: object) -> object | None:
    """The storage of a kernel library's tensor wrapper (triton_kernels' `Tensor`, which vLLM's MXFP4 MoE kernels keep
    the experts' swizzled weights and scales in: `.storage.data` a torch tensor, `.storage.layout` its swizzle); None
    for anything else."""
    st = getattr(value, "storage", None)
    return st if isinstance(getattr(st, "data", None), torch.Tensor) else None


def owned(module: torch.nn.Module) -> Iterator[tuple[str, object, str, torch.Tensor]]:
    """The tensors one module holds itself, as (name, holder, key, tensor) with `getattr(holder, key)` (or the
    module's parameter / buffer `key`) the tensor: its parameters and buffers, its plain tensor attributes,
    the tensor attributes of the plain objects it holds (an attention layer's `impl` keeps its own reference to
    GPT-OSS's sinks), and the storage of kernel tensor wrappers held by it or by those objects, or as their
    `weight_scale` (vLLM's Triton MXFP4 experts: the values on the layer, the scales in the quant method's precision
    configs; the holder is then the wrapper's storage, key "data"). Empty tensors and those whose name says cache
    (KV caches) are left out."""
    found: list[tuple[str, object, str, object]] = [
        *((k, module, k, t) for k, t in module.named_parameters(recurse=False)),
        *((k, module, k, t) for k, t in module.named_buffers(recurse=False))]

    def wrapped(name: str, value: object) -> None:
        for where, w in ((name, value), (f"{name}.weight_scale", getattr(value, "weight_scale", None))):
            st = _storage(w)
            if st is not None:
                found.append((f"{where}.storage", st, "data", st.data))

    for key, value in _held(module):
        if isinstance(value, torch.Tensor):
            if not isinstance(value, torch.nn.Parameter):
                found.append((key, module, key, value))
        elif _storage(value) is not None:
            wrapped(key, value)
        elif not isinstance(value, (torch.nn.Module, dict, list, tuple, str, type)) and not key.startswith("_"):
            for k, v in _held(value):
                if isinstance(v, torch.Tensor):
                    found.append((f"{key}.{k}", value, k, v))
                else:
                    wrapped(f"{key}.{k}", v)
    for name, holder, key, t in found:
        if isinstance(t, torch.Tensor) and t.numel() and "cache" not in name:
            yield name, holder, key, t


def _model_owned(model: torch.nn.Module) -> Iterator[tuple[str, object, torch.Tensor]]:
    for _, name, holder, t in _module_owned(model):
        yield name, holder, t


def _module_owned(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, object, torch.Tensor]]:
    """(module, name, holder, tensor) of every tensor `model` holds, once each (by storage), with its module."""
    seen: set[tuple[int, int, int]] = set()
    for mod_name, module in model.named_modules():
        for name, holder, _, t in owned(module):
            key = (t.data_ptr(), t.numel(), t.element_size())
            if key in seen:
                continue
            seen.add(key)
            yield module, f"{mod_name}.{name}" if mod_name else name, holder, t


def module_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a model holds (`owned` by each of its modules), once each, deduplicated by storage (tied
    weights count once)."""
    for name, _, t in _model_owned(model):
        yield name, t


def kernel_wrapped(model: torch.nn.Module) -> bool:
    """Whether `model` keeps any weights in kernel tensor wrappers (`owned` names them `<...>.storage`)."""
    return any(name.endswith(".storage") for module in model.modules() for name, _, _, _ in owned(module))


def held_fingerprint(holder: object, t: torch.Tensor) -> Fingerprint:
    """`tensor_fingerprint` of a tensor as its checkpoint stored it: a kernel wrapper's swizzled storage (its
    `layout.unswizzle_data`: triton_kernels' Hopper MXFP4 value layout moves bits across bytes, which a multiset of
    bytes does not forgive) is hashed as its words unpack (hopper_value_hash.py: one kernel, no unswizzle) where
    the layout is Hopper's value layout and the kernel runs, else unswizzled first, a few experts (leading index)
    at a time to bound the temporaries."""
    words = hopper_value_hash.held_words(holder, t)
    value = None if words is None else hopper_value_hash.fingerprint(words, tensor_fingerprint)
    if value is not None:
        return value
    unswizzle = getattr(getattr(holder, "layout", None), "unswizzle_data", None)
    if unswizzle is None or t.dim() < 3:
        return tensor_fingerprint(t)
    step = max(1, UNSWIZZLE_BYTES // max(1, t[0].numel() * t.element_size()))  # experts a call
    return total(tensor_fingerprint(unswizzle(t[e:e + step])) for e in range(0, t.shape[0], step))


# Bytes of swizzled storage unswizzled a call (`held_fingerprint`): a few experts at once (GPT-OSS-20B's w13 is 8.3 MB
# an expert), whose int32 temporaries stay in the hundreds of MB beside the server's own share of the GPU.
UNSWIZZLE_BYTES = 32 << 20


def model_fingerprints(model: torch.nn.Module) -> dict[str, Fingerprint]:
    """`held_fingerprint` of every tensor of `model`, by name, less a module's own tensors that a kernel wrapper of
    the same module holds again (`kept_sources`)."""
    rows = [(module, name, holder, held_fingerprint(holder, t)) for module, name, holder, t in _module_owned(model)]
    dropped = kept_sources(rows)
    return {name: value for _, name, _, value in rows if name not in dropped}


def kept_sources(rows: list[tuple[torch.nn.Module, str, object, Fingerprint]]) -> set[str]:
    """Names of the tensors a module holds itself (its parameters, buffers, plain tensor attributes) whose values a
    kernel wrapper's storage held by the same module (or its plain objects; `owned` names it `<...>.storage`) holds
    again, unswizzled equal: the source a kernel copied and the engine kept beside the copy, counted once (the copy).
    SGLang 0.5.14's MXFP4 MoE on Hopper keeps `w13_weight_scale` / `w2_weight_scale` beside the triton_kernels
    scales it swizzled from them (`layers/quantization/mxfp4.py:807-836` deletes only the weights): counted twice, a
    version's scales would be in the model's fingerprint twice and in the files' once, and no constant offset could
    cover that. A source that differs from its copy (a load that wrote one and not the other) stays counted."""
    copies: dict[int, set[Fingerprint]] = {}
    for module, name, _, value in rows:
        if name.endswith(".storage") and value != ZERO:
            copies.setdefault(id(module), set()).add(value)
    return {name for module, name, holder, value in rows
            if holder is module and not name.endswith(".storage") and value in copies.get(id(module), ())}


def _expert_bias(name: str) -> bool:
    return ".experts." in name and name.endswith("_bias")


def widened_expert_biases(model: torch.nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether `model` holds its MoE experts' biases in float32 although its dtype is 16-bit (vLLM's MXFP4 kernels
    widen them): the files' expert biases are then hashed as float32 (`files_fingerprint`)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    return any(_expert_bias(name) and t.dtype == torch.float32 for name, t in module_tensors(model))


def combine(ranks: list[dict[str, Fingerprint]]) -> Fingerprint:
    """One engine's fingerprint from its workers' per-tensor ones: a tensor with the same hash on every
    rank is replicated (counted once), any other is a shard (summed over ranks)."""
    acc = ZERO
    for name in sorted({n for r in ranks for n in r}):
        acc = add(acc, combined([int(r[name]) for r in ranks if name in r], len(ranks)))
    return acc


def combined(values: list[Fingerprint], ranks: int) -> Fingerprint:
    """One tensor's fingerprint over `ranks` workers from the hashes of those that hold it: the same hash on every
    rank is a replicated tensor (counted once), anything else shards (summed)."""
    if len(values) == ranks and all(v == values[0] for v in values):
        return values[0]
    return total(values)


KEPT_AS_STORED = ("_scale_inv",)  # fp8 block scales: the loaders keep them float32 whatever the model's dtype


def files_fingerprint(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
                      widened_biases: bool = False) -> Fingerprint:
    """The fingerprint of a checkpoint's tensors as an engine of `dtype` holds them (`as_held`)."""
    acc = ZERO
    for name, t in tensors:
        acc = add(acc, tensor_fingerprint(as_held(name, t, dtype, widened_biases)))
    return acc


def as_held(name: str, t: torch.Tensor, dtype: torch.dtype | None, widened_biases: bool = False) -> torch.Tensor:
    """A checkpoint tensor as an engine of `dtype` holds it: floating tensors cast to it, as a load does, the MoE
    experts' biases to float32 with `widened_biases` (`widened_expert_biases`); None, non-float tensors, fp8 values
    and fp8 scales (`KEPT_AS_STORED`): as stored."""
    if dtype is not None and t.is_floating_point() and t.element_size() > 1 and not name.endswith(KEPT_AS_STORED):
        return t.to(torch.float32 if widened_biases and _expert_bias(name) else dtype)
    return t


def checkpoint_tensors(path: str, device: str, keep: Callable[[str], bool] | None = None):
    """(name, tensor) of every safetensors shard in an HF directory (sorted by shard name), read by safetensors onto
    `device`; with `keep`, only the tensors whose name it keeps (the others are not read)."""
    from safetensors import safe_open

    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt", device=device) as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)
