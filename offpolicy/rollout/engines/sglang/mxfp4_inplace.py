"""MXFP4 GPT-OSS versions loaded into a running SGLang engine (`rollout.sglang.mxfp4_load: inplace`), a custom weight
loader SGLang's TP workers run (`update_weights_from_tensor(..., load_format=LOADER)`, as worker.py's).

SGLang 0.5.14's MXFP4 MoE on Hopper (triton_kernels) swizzles the experts once loaded and deletes `w13_weight` /
`w2_weight` (`layers/quantization/mxfp4.py:807-836`), so its own loader has nowhere to put a later version (KeyError,
which ends the scheduler) and each version restarts the engine (local.py; a whole start-up a version: docs/sglang.md,
"Low-bit versions"). This loader writes a version's experts where the kernels read them instead, in place, as SGLang
laid out the first one (the steps shared with vLLM's: mxfp4_kernels.py):
- the values (`<experts>.gate_up_proj_blocks` [E, 2I, H/32, 16] uint8, `down_proj_blocks` [E, H, I/32, 16]) are
  viewed as the parameters SGLang loaded them into ([E, rows, cols / 2], `models/gpt_oss.py:960-1000`: a plain copy
  with one TP and EP rank), transposed and swizzled by the running wrapper's own layout (`storage.layout.
  swizzle_data`, what `_swizzle_mxfp4`'s `convert_layout` ran on them, `mxfp4.py:167-198`), then copied into its
  storage (`quant_method.w13_weight_triton_tensor`);
- the scales likewise into the precision config's wrapper (`quant_method.w13_precision_config.weight_scale`), and
  into the `w13_weight_scale` Parameter SGLang keeps beside it (so the fingerprint counts them once,
  `fingerprint.kept_sources`);
- the biases into the float32 `w13_weight_bias` / `w2_weight_bias` (`mxfp4.py:810-814`);
- every other tensor (attention, router, norms, embeddings) by the model's own `load_weights`.
In an engine of several GPUs (`rollout.sglang.mxfp4_load: inplace` with tp_size > 1) each TP worker writes its own
part, cut as SGLang's loader cut the first version (`shard`: the intermediate dimension over MoE TP, down's bias on
MoE-TP rank 0; experts over EP, which the config check refuses: SGLang then leaves triton_kernels) and zero-padded to
what its layer holds (`mxfp4_kernels.as_held`). A shape larger than the running one (another model or layout) is not
written: the load's fingerprint proof then fails, naming the group. Nothing raises out of it: an exception from a
weight loader would end SGLang's scheduler (worker.py); it is logged, and the proof refuses the load. Imports torch and
worker.py, nothing of SGLang until a load asks its parallel state (`shard`): tested on CPU with stand-in wrappers.
"""

from __future__ import annotations

import logging
import traceback

import torch

from offpolicy.rollout.engines.mxfp4_kernels import WHOLE, Shard, as_held, into_bias, into_wrapper, split
from offpolicy.rollout.engines.sglang.worker import copied

log = logging.getLogger("offpolicy.sglang")

LOADER = "offpolicy.rollout.engines.sglang.mxfp4_inplace.offpolicy_load_mxfp4"


def shard() -> Shard:
    """This TP worker's part of the experts, as SGLang's GPT-OSS MXFP4 loader cuts them (`mxfp4_kernels.Shard`): its
    MoE TP and EP sizes and ranks (0.5.14 `runtime_context.get_parallel`, what `models/gpt_oss.py:919-922` reads);
    whole where SGLang is not there to say (a CPU test's stand-in)."""
    try:
        from sglang.srt.runtime_context import get_parallel  # late: SGLang's, in its TP worker
    except ImportError:
        return WHOLE
    p = get_parallel()
    return Shard(int(p.moe_tp_size), int(p.moe_tp_rank), int(p.moe_ep_size), int(p.moe_ep_rank))


def write(experts: torch.nn.Module, proj: str, part: str, t: torch.Tensor, cut: Shard = WHOLE) -> str | None:
    """Write one part of one projection into SGLang's running experts module, this worker's part of it (`cut`) as
    the layer holds it; why not (None when written)."""
    t = as_held(getattr(experts, "w13_weight_bias", None), proj, part, t, cut)
    if part == "bias":
        return into_bias(getattr(experts, f"{proj}_weight_bias", None), t, f"{proj}_weight_bias")
    qm = getattr(experts, "quant_method", None)
    wrapper = (getattr(qm, f"{proj}_weight_triton_tensor", None) if part == "value"
               else getattr(getattr(qm, f"{proj}_precision_config", None), "weight_scale", None))
    why = into_wrapper(wrapper, part, t)
    if why is not None:
        return f"{proj} {why}"
    kept = getattr(experts, f"{proj}_weight_scale", None) if part == "scale" else None
    if isinstance(kept, torch.Tensor) and kept.shape == t.shape:
        kept.data.copy_(t)  # the Parameter SGLang keeps beside the kernel's copy
    return None


def offpolicy_load_mxfp4(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom weight loader call (the module docstring): the experts into the kernels' storage, the rest by
    the model's `load_weights`; then waits for the copies on the worker's GPUs (its answer means they are done, as
    worker.SYNCED_LOADER's). Never raises."""
    named = list(named_tensors)
    try:
        experts, rest = split(named)
        if rest:
            model.load_weights(rest)
        refused, cut = [], shard()
        with torch.inference_mode():  # SGLang's kernel tensors may be inference tensors: written in place only here
            for module, proj, part, t in experts:
                why = write(model.get_submodule(module), proj, part, t, cut)
                if why is not None:
                    refused.append(f"{module}: {why}")
        if refused:
            log.error("offpolicy's MXFP4 loader left %d expert tensors as they were (the load's proof will fail): %s",
                      len(refused), "; ".join(refused[:4]))
        copied(named)
    except Exception as e:  # any: one raised here would end SGLang's scheduler (worker.py)
        log.error("offpolicy's MXFP4 loader failed (the load's proof will fail): %s: %s\n%s", type(e).__name__, e,
                  traceback.format_exc(limit=6))
