"""How the torch engine multiplies an fp8 version's linear weights (`rollout.fp8_matmul`): kept in fp8 and run through
torch's scaled matmul (`fp8_linear.Fp8Linear`), or dequantized to the model's dtype on load as before.

`plan(cfg, model, device)` decides once, at the engine's start (the double buffer's second set of weights and the
decode graphs are made from the model as it then is), and says why in one log line:

- `rollout.weights_format` native: nothing to decide (`off`); mxfp4: `dequantize`, since mxfp4 versions quantize
  only GPT-OSS's 3-D MoE experts, and torch's MX scaled matmuls (1 x 32 e8m0 blocks) run on SM100 only;
- `dequantize`: today's path, the version dequantized on the engine's device and copied into model.dtype weights
  (generation then costs what bf16 costs);
- `scaled`: every `nn.Linear` whose weight the fp8 version quantizes (`weights.fp8.quantizable` under
  `weights.fp8_skip`) becomes an `Fp8Linear` with the run's block (`weights.fp8_block_size`, resolved as the learner
  resolves it). On CUDA the kernel must serve the model (`kernel_problems`: SM90, torch's
  `torch.nn.functional.scaled_mm`, weight blocks of 128 x 128, inputs and outputs multiples of 128) and is first checked against
  the float32 reference on random weights of each shape (`probe`), else the engine refuses to start, naming why; on
  a CPU it runs the float32 reference of the same math (`kernel="reference"`, for tests: no fp8 kernel there);
- `auto` (the default): `scaled` where the CUDA kernel serves the model and the probe measured the model's fp8
  linears faster than their bf16 matmuls at the decode batch (`groups_per_lease x n_samples` rows), else
  `dequantize`, with the reason.

All or nothing: a model with an fp8 weight that is no `nn.Linear`'s (Qwen3-MoE's experts, fused 3-D tensors in
transformers 5 and per-expert 2-D tensors in the checkpoint) keeps `dequantize`. GPT-OSS's 64 x 64 blocks (hidden
2880 = 22.5 x 128) are outside what torch's kernel takes, so its fp8 versions are dequantized: an exact mapping
needs 1 x 64 activation groups, which no torch recipe on SM90 has, and re-quantizing the weights into 128-wide
groups would hold other weights than the version's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from offpolicy.models.build import checkpoint_tensors
from offpolicy.rollout.engines.fp8_linear import Fp8Linear, kernel_problems, quantize_activations, reference_product

if TYPE_CHECKING:
    from offpolicy.config import Config

log = logging.getLogger("offpolicy.rollout.engines.torch")

TOLERANCE = 2e-2  # probe: max |kernel - reference| over max |reference| (bf16 output: 2^-8 relative per element)


@dataclass(frozen=True)
class Fp8Plan:
    mode: str  # "off" (native versions), "dequantize" or "scaled"
    reason: str
    kernel: str = ""  # scaled: "cuda" (torch's scaled_mm) or "reference" (float32, any device)
    block: tuple[int, int] | None = None  # scaled: the fp8 versions' weight_block_size
    modules: tuple[str, ...] = ()  # scaled: the nn.Linear modules that became Fp8Linear

    @property
    def scaled(self) -> bool:
        return self.mode == "scaled"


def targets(model: torch.nn.Module, skip) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """({module: (out, in)} of the nn.Linear modules whose weight an fp8 version quantizes, [checkpoint names of the
    quantized weights that are no nn.Linear's])."""
    from offpolicy.weights import fp8

    linears, strays = {}, []
    modules = dict(model.named_modules())
    for name, t in checkpoint_tensors(model).items():
        if not fp8.quantizable(name, t, skip):
            continue
        module = modules.get(name[: -len(".weight")])
        if type(module) is torch.nn.Linear:
            linears[name[: -len(".weight")]] = (module.out_features, module.in_features)
        else:
            strays.append(name)
    return linears, strays


def plan(cfg: Config, model: torch.nn.Module, device: torch.device) -> Fp8Plan:
    """`rollout.fp8_matmul` resolved for this engine's model and device (see the module doc)."""
    setting, fmt = cfg.rollout.fp8_matmul, cfg.rollout.weights_format
    if fmt == "native":
        return Fp8Plan("off", "native versions")
    if fmt == "mxfp4":
        return Fp8Plan("dequantize", "mxfp4 versions are dequantized to model.dtype on load: torch's MX scaled "
                                     "matmuls run on SM100 only, and mxfp4 holds only the 3-D MoE experts")
    if setting == "dequantize":
        return Fp8Plan("dequantize", "rollout.fp8_matmul=dequantize")
    from offpolicy.weights import fp8_blocks

    block = fp8_blocks.for_run(cfg, {n: tuple(t.shape) for n, t in checkpoint_tensors(model).items()})
    linears, strays = targets(model, cfg.weights.fp8_skip)
    why = ""
    if strays:
        why = f"{strays[0]} is quantized in fp8 but held by no nn.Linear (e.g. fused MoE experts)"
    elif not linears:
        why = "the model has no linear that fp8 versions quantize"
    elif device.type != "cuda":
        if setting == "scaled":
            return Fp8Plan("scaled", f"no fp8 kernel on {device.type}: the float32 reference of the same math (for "
                                     "tests; slower than dequantize)", "reference", block, tuple(linears))
        why = f"no fp8 matmul kernel on {device.type}"
    else:
        why = "; ".join(support_problems(device) + kernel_problems(linears, block))
        if not why:
            rows = cfg.rollout.groups_per_lease * cfg.rollout.n_samples
            why, timing, faster = _measure(linears, block, device, rows, _dtype(model))
            if not why and (faster or setting == "scaled"):
                return Fp8Plan("scaled", "torch's scaled_mm: " + timing, "cuda", block, tuple(linears))
            why = why or "measured slower: " + timing
    if setting == "scaled":
        raise ValueError(f"rollout.fp8_matmul=scaled, but {why}; set rollout.fp8_matmul=auto or dequantize")
    return Fp8Plan("dequantize", why)


def _measure(linears: dict[str, tuple[int, int]], block: tuple[int, int], device: torch.device, rows: int,
             dtype: torch.dtype) -> tuple[str, str, bool]:
    """(why the kernel cannot serve, "" if it can; the timings; whether fp8 was faster) from `probe`."""
    try:
        fp8_s, dense_s, error = probe(linears, block, device, rows, dtype)
    except (RuntimeError, ValueError, TypeError) as e:  # torch's refusals: TORCH_CHECK, TORCH_CHECK_VALUE, a signature
        return f"torch's scaled_mm failed on this GPU ({type(e).__name__}: {str(e).splitlines()[0]})", "", False
    if error > TOLERANCE:
        return (f"torch's scaled_mm differs from the float32 reference by {error:.3g} (relative; more than "
                f"{TOLERANCE}) on this GPU"), "", False
    timing = (f"the model's fp8 linears took {fp8_s * 1e3:.3f} ms against {dense_s * 1e3:.3f} ms in {dtype} at "
              f"{rows} rows (a decode step)")
    return "", timing, fp8_s < dense_s


def support_problems(device: torch.device) -> list[str]:
    """Why this torch and this GPU have no block-scaled fp8 matmul (1x128 activations, 128x128 weights); []."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return [f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (2.10 or later)"]
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return [f"the GPU is SM{major}{minor}: torch's 1x128 / 128x128 block-scaled matmul runs on SM90 only"]
    return []


def convert(model: torch.nn.Module, p: Fp8Plan) -> None:
    """Replace each of `p.modules` (nn.Linear) with an `Fp8Linear` holding its weight quantized in `p.block`."""
    with torch.no_grad():
        for name in p.modules:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, Fp8Linear.of(owner.get_submodule(leaf), p.block, p.kernel))


def check_version(version: int, fmt: str, qc: dict, p: Fp8Plan) -> None:
    """Refuse a version an engine holding fp8 weights in `p.block` cannot read byte for byte."""
    block = tuple(qc.get("weight_block_size") or ())
    if fmt != "fp8" or block != tuple(p.block):
        raise ValueError(f"weight version {version} is {fmt}{f' in {list(block)} blocks' if block else ''}, but the "
                         f"engine holds fp8 weights in {list(p.block)} blocks (rollout.fp8_matmul, "
                         "weights.fp8_block_size)")


def probe(linears: dict[str, tuple[int, int]], block: tuple[int, int], device: torch.device, rows: int,
          dtype: torch.dtype) -> tuple[float, float, float]:
    """(seconds of the fp8 linears, seconds of the same matmuls in `dtype`, the largest relative error of the kernel
    against `reference_product`), one forward of every linear in `linears` at `rows` rows, on random weights."""
    from offpolicy.weights import fp8

    counts: dict[tuple[int, int], int] = {}
    for shape in linears.values():
        counts[shape] = counts.get(shape, 0) + 1
    fp8_s = dense_s = error = 0.0
    g = torch.Generator(device=device).manual_seed(0)
    for (n, k), count in counts.items():
        w = torch.randn((n, k), generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        x = torch.randn((rows, k), generator=g, device=device, dtype=torch.float32).to(dtype)
        dense = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(w)
            lin = Fp8Linear.of(dense, block, "cuda")
            y = lin(x).float()
            ref = reference_product(*quantize_activations(x), lin.weight, lin.weight_scale_inv, block)
            error = max(error, float((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
            fp8_s += count * _timed(lin, x)
            dense_s += count * _timed(dense, x)
        del w, x, dense, lin
    return fp8_s, dense_s, error


def _timed(f, x: torch.Tensor, n: int = 20) -> float:
    """Seconds per call of `f(x)` on the GPU: `n` calls after two warm-ups."""
    for _ in range(2):
        f(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
