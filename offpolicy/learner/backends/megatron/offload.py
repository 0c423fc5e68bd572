"""The optimizer on the host (`learner.megatron.optimizer_offload`): megatron-core's own pieces, without TE or Apex.

A model whose Adam state does not fit beside it on the GPU (GPT-OSS-20B on 4 x 80 GB: ~6.6B parameters a rank
under EP4, 12 bytes of fp32 state each) trains with megatron-core's `HybridDeviceOptimizer` and its
precision-aware optimizer (`use_precision_aware_optimizer`): the distributed optimizer's shards stay bf16 views
of the model's parameters, each step copies their gradients to the host, steps torch's fused AdamW on fp32
master weights and moments there, and copies the new weights back into the parameter buffer before the
all-gather. The GPU then holds only the model's weights and its gradient buffer; the host holds 16 bytes of state per
parameter this rank updates (fp32 master, m, v and the gradient's staging copy; `memory.HOST_BYTES_PER_PARAM` is the
host memory measured with it).

What megatron-core does here, and what this module adds (read against megatron-core 0.16.1 and 0.19.2):
- The precision-aware optimizer needs TE's FusedAdam except with CPU offload, where the hybrid optimizer steps
  torch's AdamW; `optimizer_fields` turns both on together. megatron-core 0.16.1 asks for TE's version before
  it looks at the offload and compares None with a version when TE is absent: `prepare` records TE's version
  as 0.0.0 there, as 0.19.2 does itself.
- Without TE the hybrid optimizer's GPU part is torch AdamW too, which its state reload mistakes for the host
  part (it moves that state to the host after every checkpoint load): fractions between 0 and 1 need TE, and
  `prepare` says so by field.
- The hybrid optimizer keeps fp32 state whatever `main_params_dtype` / `exp_avg_dtype` say (those reach only
  TE's FusedAdam), so no bf16-moment knob is offered.
- Each rank's host Adam runs on torch's CPU threads: `share_cores` gives each rank of the node its share of the
  cores (unless `run.torch_threads` is set).
- Its first instance, which the distributed optimizer discards and rebuilds over the shards, copied every
  local parameter to the host and lives in reference cycles: `collect` frees it once the optimizer is built.
- Checkpoints: `init_state` gives a hybrid optimizer that has not stepped the state Adam's first step would
  (the distributed optimizer's state_dict asserts on an empty one), written into its sub-optimizers and synced
  back, never by a dummy step (which would move the weights).
"""

from __future__ import annotations

import gc
import logging
import os
import warnings

import torch

from offpolicy.config import ConfigError, MegatronConfig
from offpolicy.learner.backends.megatron import heap
from offpolicy.learner.backends.megatron.checkpointing.per_rank import chained

log = logging.getLogger("offpolicy.learner")


def enabled(mc: MegatronConfig) -> bool:
    return mc.optimizer_offload > 0


def optimizer_fields(mc: MegatronConfig, cuda: bool) -> dict:
    """The OptimizerConfig fields of `learner.megatron.optimizer_offload` ({} when it is 0)."""
    if not enabled(mc):
        return {}
    return dict(use_precision_aware_optimizer=True, optimizer_cpu_offload=True,
                optimizer_offload_fraction=float(mc.optimizer_offload),
                overlap_cpu_optimizer_d2h_h2d=mc.offload_overlap and cuda, pin_cpu_grads=cuda, pin_cpu_params=cuda)


def have_te_adam() -> bool:
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True


def prepare(mc: MegatronConfig) -> None:
    """Before the first OptimizerConfig with offload: TE's version where TE is absent (megatron-core 0.16.1
    compares it), and a partial offload refused where only torch's AdamW can step the GPU part."""
    if not enabled(mc):
        return
    if 0 < mc.optimizer_offload < 1 and not have_te_adam():
        raise ConfigError(f"config field learner.megatron.optimizer_offload is {mc.optimizer_offload}: a partial offload "
                          "needs Transformer Engine's FusedAdam for the GPU part (without it megatron-core moves that "
                          "part's state to the host at every checkpoint load); use 1.0, or 0, or install "
                          "transformer-engine")
    import megatron.core.utils as mu
    from packaging.version import Version

    if getattr(mu, "get_te_version", None) is not None and mu.get_te_version() is None:
        mu._te_version = Version("0.0.0")


def share_cores(mc: MegatronConfig, torch_threads: int) -> int | None:
    """With the optimizer on the host of a GPU learner, each rank's host Adam runs on torch's CPU threads, and
    every rank of the node starts with all cores: unless `run.torch_threads` says otherwise, give each rank its
    share (cores / local ranks), so that the node's ranks do not oversubscribe the cores. Returns what it set."""
    if not enabled(mc) or torch_threads:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(1, torch.cuda.device_count())
    threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)
    return threads


def settle(opt, mc: MegatronConfig, cuda: bool, torch_threads: int, rank: int) -> None:
    """Once the optimizer is built (nothing without `optimizer_offload`): the discarded first host optimizer's
    copies freed (`collect`), the C heap trimmed, and on a GPU each rank given its share of the cores."""
    if not enabled(mc):
        return
    collect(opt)
    heap.trim()
    threads = share_cores(mc, torch_threads) if cuda else None
    if threads and rank == 0:
        log.info("learner.megatron.optimizer_offload: the optimizer steps on the host, %d CPU threads a rank", threads)


def collect(opt) -> int:
    """Free the host copies of the hybrid optimizers `opt` does not use: the distributed optimizer discards the
    first one get_megatron_optimizer built over the unsharded parameters (6 bytes a local parameter on the host),
    which stays reachable (a GPU run kept it past a collection: the node's host memory held both). Each stale one
    drops its copies and sub-optimizers; then the pinned blocks torch's host allocator keeps cached (each copy
    passed through a pinned bf16 clone) go back to the system. Returns how many it found."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    gc.collect()
    live = {id(h) for h in hybrids(opt)}
    with warnings.catch_warnings():  # isinstance on every object wakes deprecation warnings of lazy modules
        warnings.simplefilter("ignore")
        stale = [o for o in gc.get_objects() if isinstance(o, HybridDeviceOptimizer) and id(o) not in live]
    for old in stale:
        for name in ("cpu_copys_map_gpu_param", "gpu_params_map_cpu_copy", "param_to_fp32_param", "cpu_copy_map_grad",
                     "fp32_param_to_orig_param", "param_to_inner_param", "inner_param_to_orig_param", "state"):
            table = getattr(old, name, None)
            if isinstance(table, dict):
                table.clear()
        old.cpu_optimizers, old.gpu_optimizer, old.cpu_param_groups, old.gpu_param_groups = [], None, [], []
        old.param_groups = []
    found = len(stale)
    del stale
    gc.collect()
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # cached pinned blocks back to the system
    return found


def hybrids(opt) -> list:
    """The HybridDeviceOptimizers inside a Megatron optimizer (chained or not)."""
    return [o.optimizer for o in chained(opt) if is_hybrid(o.optimizer)]


def is_hybrid(inner) -> bool:
    try:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    except ImportError:  # a megatron-core without offload has none
        return False
    return isinstance(inner, HybridDeviceOptimizer)


def init_state(hdo) -> None:
    """Adam's state before its first step (step 0, zero moments) in each sub-optimizer that has none, synced
    into the hybrid optimizer's own state (with its fp32 master weights)."""
    for sub in hdo.sub_optimizers:
        for group in sub.param_groups:
            for p in group["params"]:
                if not sub.state[p]:
                    sub.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                        exp_avg_sq=torch.zeros_like(p))
    hdo._sync_sub_optimizers_state_to_hdo()


def host_bytes(opt) -> int:
    """Bytes of optimizer state this rank holds on the host (master weights, moments, gradient staging)."""
    seen: dict[int, int] = {}  # storage address -> bytes (the synced state holds the master weight twice)
    for hdo in hybrids(opt):
        for sub in hdo.sub_optimizers:
            for group in sub.param_groups:
                for p in group["params"]:
                    if p.device.type != "cpu":
                        continue
                    for t in (p, p.grad, *sub.state[p].values()):
                        if torch.is_tensor(t) and t.device.type == "cpu":
                            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
