"""Learner checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint of step `S` (the state after S optimizer steps, steps 0..S-1, i.e. weight version S; a
resume runs step S next: docs/architecture.md "Steps and versions") is a directory
`<run dir>/checkpoints/step-<S>/` holding:
- `backend/`: the backend's own files (for `torch`: `model.safetensors` in HF names, `optimizer.pt`
  loaded with `weights_only=True`, never unpickled code);
- `rng.safetensors`: torch's RNG state;
- `hf/`: the HF export of the model at that step, a copy of weight version S from the store
  (safetensors shards in HF names + `config.json`: `AutoModelForCausalLM.from_pretrained` and SGLang
  load it; the tokenizer is the run's `model.tokenizer`), when that version is in the store;
- `state.json`: step, the prompt cursor (epoch, position, fresh prompts handed out, and the prompts to
  hand out first: its requeue plus every prompt leased or buffered but not trained at that moment),
  python's RNG state, and the config fields a resume must not change.
It is written into a hidden sibling and renamed into place; the newest `checkpoint.keep` stay. What
was trained comes from the run directory's `trained.jsonl` / `metrics.jsonl`, which a resume
truncates to the checkpoint's step (the steps after it are redone from the same prompts).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from offpolicy.config import Config
from offpolicy.hub.leases import CursorState

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointState(msgspec.Struct):
    step: int
    cursor: CursorState
    python_rng: list
    fingerprint: dict[str, object]  # config fields that must match on resume


def fingerprint(cfg: Config) -> dict[str, object]:
    """Config fields whose change would make a resumed run a different run."""
    return {"data": msgspec.to_builtins(cfg.data), "learner.batch_groups": cfg.learner.batch_groups,
            "rollout.n_samples": cfg.rollout.n_samples, "model.arch": cfg.model.arch, "model.path": cfg.model.path}


def exports(cfg: Config, version: int) -> bool:
    """Whether a checkpoint follows `version`'s step in the ordinary course of a run (every checkpoint.every_steps,
    and checkpoint.final's at learner.total_steps): the versions that weights.native=checkpoints writes in the
    native format, for the checkpoint's hf/ export."""
    c = cfg.checkpoint
    periodic = c.every_steps > 0 and version > 0 and version % c.every_steps == 0
    return periodic or (c.final and version == cfg.learner.total_steps)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[int]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for e in os.scandir(root) if (m := _STEP_DIR.match(e.name))
             and os.path.exists(os.path.join(e.path, "state.json"))]
    return sorted(steps)


def save(run_dir: Path, state: CheckpointState, backend, keep: int, hf_version: Path | None = None) -> Path:
    """Write checkpoint `state.step` atomically, then keep only the newest `keep`. `hf_version`: the
    store's directory of weight version `state.step`, copied in as the HF export `hf/`."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:06d}"
    tmp = root / f".step-{state.step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    try:
        (tmp / "backend").mkdir()
        backend.save_checkpoint(tmp / "backend")
        save_file({"torch": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        if hf_version is not None:
            shutil.copytree(hf_version, tmp / "hf")
        (tmp / "state.json").write_bytes(msgspec.json.encode(state))  # written last: marks it complete
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(root / f"step-{old:06d}", ignore_errors=True)
    return final


def load(run_dir: Path, cfg: Config, backend) -> CheckpointState:
    """Restore the newest checkpoint into `backend` and the RNGs; returns its state."""
    steps = list_checkpoints(run_dir)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {checkpoint_root(run_dir)}: nothing to resume; "
                                "start without --resume")
    path = checkpoint_root(run_dir) / f"step-{steps[-1]:06d}"
    state = msgspec.json.decode((path / "state.json").read_bytes(), type=CheckpointState)
    now = msgspec.json.decode(msgspec.json.encode(fingerprint(cfg)))
    changed = [k for k in now if now[k] != state.fingerprint.get(k)]
    if changed:
        raise ValueError(f"cannot resume from {path}: {', '.join(changed)} changed since the checkpoint; "
                         "resume with the run's own config (see its config.yaml)")
    backend.load_checkpoint(path / "backend")
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch"])
    random.setstate(_as_rng_state(state.python_rng))
    return state


def python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _as_rng_state(saved: list) -> tuple:
    version, internal, gauss = saved
    return version, tuple(internal), gauss
