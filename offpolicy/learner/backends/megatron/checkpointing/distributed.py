"""Megatron distributed checkpoints of the megatron backend: model and optimizer state, reshardable.

`save` writes one `megatron.core.dist_checkpointing` checkpoint (torch_dist: `*.distcp` files written
by every rank, `.metadata`, `metadata.json`, the common state) of the model's `sharded_state_dict()` and
each Megatron optimizer's `sharded_state_dict(...)` into a directory every rank sees; then rank 0 writes
`offpolicy_megatron.json` (format, the layout it was written with, the Adam step), last, so it marks
the checkpoint complete. Tensors are stored as global tensors, so `load` restores them under another
tp/pp/dp/ep/etp layout: each rank reads the slices its own layout needs.

The distributed optimizer uses the `fully_reshardable` sharding (Adam moments and fp32 main parameters
in model-parameter shape; megatron-core 0.16's ShardedTensor refuses the default,
`fully_sharded_model_space`). Each optimizer that Megatron chained (MoE with ep > 1: dense and expert)
is asked on its own, so no key carries a `chained_<i>.` prefix: expert moments saved by the expert
optimizer (ep 2) load into the single optimizer of ep 1. Only the tensors go into the checkpoint; the
optimizer's hyperparameters come from the config at resume and the Adam step is one number in the
JSON. Without Apex/TE (torch Adam; megatron-core 0.16.1 and 0.19.2 alike) the optimizers need three
workarounds, kept here: `DistributedOptimizer.state_dict()` asserts on the empty state of an optimizer
that has not stepped, so `_init_state` creates it as Adam's first step would (step 0, zero moments);
its `load_state_dict` copies the loaded parameter state into every state tensor including `step`,
which the checkpoint lacks (KeyError), and hands every parameter one shared `step` tensor that torch
Adam would increment once per parameter, so `_load_optimizer` loads the parameter state without the
steps and `_set_step` gives each parameter its own; FP32Optimizer/Float16Optimizer save no step at
step 0, so the step is handed to them as `common_step`. The host optimizer (`learner.megatron.optimizer_offload`,
megatron's HybridDeviceOptimizer) saves the same tensors (its fp32 master as the main parameter, its moments) and
keeps steps per parameter as torch Adam does, so checkpoints move between an optimizer on the GPU and one on the
host; `offload.init_state` gives it its first state.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from offpolicy.learner.backends.megatron import offload
from offpolicy.learner.backends.megatron.checkpointing.per_rank import chained

META_FILE = "offpolicy_megatron.json"
FORMAT = "megatron-dist"
# the distributed optimizer's sharding that reshards over tp/pp/dp; keys without the chained-optimizer prefix
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def is_dist_checkpoint(path: str) -> bool:
    return (Path(path) / META_FILE).exists()


def save(path: str, *, model, opt, layout: dict, control) -> None:
    """Write the model and optimizer state into `path` (an existing directory every rank sees); collective."""
    from megatron.core import dist_checkpointing

    _require_psutil()
    _init_state(opt)
    model_sd = _module(model).sharded_state_dict()
    optim_sd = [_tensors(o.sharded_state_dict(model_sd, is_loading=False, metadata=dict(OPTIMIZER_METADATA)))
                for o in chained(opt)]
    step, scaler = _step(opt), _scaler(opt)
    dist_checkpointing.save({"model": model_sd, "optimizer": _as_dict(optim_sd), "grad_scaler": scaler}, Path(path))
    if dist.get_rank() == 0:
        meta = dict(format=FORMAT, version=1, layout=layout, step=step, megatron_core=version("megatron-core"))
        (Path(path) / META_FILE).write_text(json.dumps(meta, indent=1))
    dist.barrier(group=control)


def load(path: str, *, model, opt, layout: dict, control) -> None:
    """Restore the model and optimizer state from `path`, written under any layout; collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    meta = read_meta(path)
    _check_version(path, meta["megatron_core"])
    saved = meta["layout"]
    if _main_params(layout) and not _main_params(saved):
        raise ValueError(f"checkpoint {path} was written in float32 without the distributed optimizer, so it holds "
                         "no fp32 main parameters, which this learner's optimizer needs: resume with "
                         "learner.megatron.use_distributed_optimizer=false and model.dtype=float32")
    _init_state(opt)
    module = _module(model)
    model_sd = module.sharded_state_dict()
    optims = chained(opt)
    full = [o.sharded_state_dict(model_sd, is_loading=True, metadata=dict(OPTIMIZER_METADATA)) for o in optims]
    try:
        state = dist_checkpointing.load({"model": model_sd, "optimizer": _as_dict([_tensors(f) for f in full])},
                                        Path(path))
    except (CheckpointingException, CheckpointException, FileNotFoundError) as e:
        raise ValueError(f"cannot load the Megatron distributed checkpoint {path} (written with layout {saved}, "
                         f"this learner has {layout}): {type(e).__name__}: {e}; it is incomplete or corrupt, or "
                         "the model differs: resume from another checkpoint (remove this step directory) or "
                         "start the run anew") from e
    module.load_state_dict(state["model"])
    for i, (o, f) in enumerate(zip(optims, full)):
        _put(f, state["optimizer"].get(i, {}))
        _load_optimizer(o, f, int(meta["step"]))
    _set_step(opt, int(meta["step"]))
    if state.get("grad_scaler") is not None:
        for o in optims:
            if getattr(o, "grad_scaler", None) is not None:
                o.grad_scaler.load_state_dict(state["grad_scaler"])
    dist.barrier(group=control)


def read_meta(path: str) -> dict:
    """The checkpoint's `offpolicy_megatron.json`; ValueError naming the fix when it is missing or unreadable."""
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is missing or unreadable ({e}): {path} is not a complete megatron backend "
                         "checkpoint; resume from another checkpoint or start the run anew") from e
    if meta.get("format") != FORMAT or meta.get("version") != 1:
        raise ValueError(f"{file} names format {meta.get('format')!r} version {meta.get('version')!r}; this "
                         f"offpolicy reads {FORMAT!r} version 1")
    missing = {"layout", "step", "megatron_core"} - set(meta)
    if missing:
        raise ValueError(f"{file} lacks {sorted(missing)}: {path} is not a complete megatron backend checkpoint; "
                         "resume from another checkpoint or start the run anew")
    return meta


# -- helpers ---------------------------------------------------------------------------------------
def _check_version(path: str, saved: str) -> None:
    """A newer megatron-core may write what an older one cannot read (0.19 keeps the common state inside
    the torch_dist files, 0.16 looks for common.pt); older checkpoints load (0.19 reads common.pt)."""
    from packaging.version import Version

    here = version("megatron-core")
    if Version(saved).release[:2] > Version(here).release[:2]:
        raise ValueError(f"checkpoint {path} was written by megatron-core {saved} and this learner has {here}, "
                         f"which may not read its format: install megatron-core>={saved} to resume from it")


def _module(model):
    return getattr(model, "module", model)  # the GPTModel inside Megatron DDP


def _require_psutil() -> None:
    try:
        import psutil  # noqa: F401  (megatron-core's torch_dist writer processes need it)
    except ImportError:
        raise RuntimeError("saving a Megatron distributed checkpoint needs psutil: pip install psutil (or pip "
                           "install -e '.[megatron]'), or set learner.megatron.checkpoint_format=per_rank") from None


def _main_params(layout: dict) -> bool:
    """Whether the optimizer keeps fp32 main parameters apart from the model's (saved as `fp32_param`)."""
    return layout["use_distributed_optimizer"] or layout["dtype"] != "float32"


def _is_torch_adam(inner) -> bool:
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _per_param_steps(inner) -> bool:
    """Whether the optimizer keeps Adam's step per parameter: torch Adam, and the host optimizer (whose state
    dicts are its torch AdamW sub-optimizers'), rather than per group as TE's/Apex's FusedAdam."""
    return _is_torch_adam(inner) or offload.is_hybrid(inner)


def _init_state(opt) -> None:
    """Give a torch Adam (or the host optimizer) that has not stepped yet its state (step 0, zero moments), as
    its first step would."""
    for o in chained(opt):
        inner = o.optimizer
        if offload.is_hybrid(inner):
            offload.init_state(inner)
            continue
        if not _is_torch_adam(inner):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


def _step(opt) -> int:
    """The optimizer step, shared by every parameter: per parameter in torch Adam (whose param groups may
    carry a stale `step` that the distributed optimizer's load put there), per group in FusedAdam."""
    steps = set()
    for o in chained(opt):
        inner = o.optimizer
        if _per_param_steps(inner):
            steps |= {int(s["step"]) for s in inner.state.values() if "step" in s}
        else:
            steps |= {int(g["step"]) for g in inner.param_groups if "step" in g}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's parameters are at different steps {sorted(steps)}")
    return steps.pop() if steps else 0


def _set_step(opt, step: int) -> None:
    for o in chained(opt):
        inner = o.optimizer
        if _per_param_steps(inner):
            for s in inner.state.values():
                s["step"] = torch.tensor(float(step))  # one tensor per parameter (on the host: the fused kernel's
                # device for the host optimizer; adam.place_steps moves torch Adam's to the parameter's)
        else:
            for group in inner.param_groups:
                if "step" in group:
                    group["step"] = step


def _load_optimizer(o, state: dict, step: int) -> None:
    """Load one (non-chained) Megatron optimizer's state dict at Adam step `step` (see the module docstring:
    the distributed optimizer's parameter state is copied without the steps; the others get `common_step`)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    param_state = None
    if isinstance(o, DistributedOptimizer):
        param_state = state.pop("param_state", None)
    else:  # Float16Optimizer nests the torch optimizer's state dict under "optimizer"
        state.get("optimizer", state)["state"]["common_step"] = torch.tensor(float(step))
    with torch.no_grad():  # the optimizer copies into views of parameters that require grad
        o.load_state_dict(state)
        if param_state is not None:
            for s in o.optimizer.state.values():
                s.pop("step", None)
            o.load_parameter_state_from_fully_reshardable(param_state)


def _as_dict(items: list) -> dict:
    return dict(enumerate(items))


def _scaler(opt) -> dict | None:
    scaler = getattr(chained(opt)[0], "grad_scaler", None)
    return scaler.state_dict() if scaler is not None else None


def _is_sharded(v) -> bool:
    """A leaf dist_checkpointing handles: a sharded tensor/object, or a value kept out of the files
    (`LocalNonpersistentObject`, e.g. the optimizer's parameter ids, unwrapped by `load`)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    return isinstance(v, (ShardedBase, LocalNonpersistentObject))


def _tensors(tree):
    """The leaves of a state dict that `_is_sharded`, lists turned into dicts keyed by index (the paths `_put`
    follows); the rest (hyperparameters, the step) stays out of the checkpoint."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out = {}
    for k, v in items:
        if isinstance(v, (dict, list)):
            sub = _tensors(v)
            if sub:
                out[k] = sub
        elif _is_sharded(v):
            out[k] = v
    return out


def _put(tree, values: dict) -> None:
    """Write the loaded `values` (the shape `_tensors` gave) into `tree` at the same paths."""
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(tree[k], (dict, list)):
            _put(tree[k], v)
        else:
            tree[k] = v
