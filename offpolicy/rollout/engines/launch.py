"""What vLLM and SGLang servers launched by offpolicy share (`offpolicy run`, `offpolicy bench pipeline`, deploy/slurm):
the checkpoint they start from, and the wait for their /health.

vLLM and SGLang both build their layers for the quantization of the checkpoint they launch with, so a server that
will load low-bit versions must start from a checkpoint in that format; and a model built from `model.arch` has no
directory to launch from. `initial_model` makes what is missing under the run directory: the model saved (same seed,
so the same weights as version 0), converted into the versions' format (`weights.convert`). A restarted server finds
it again there. `wait_healthy` waits for a started server's /health, failing at once, with its log's end, when its
process exits first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from offpolicy.config import Config
from offpolicy.plumbing.logs import dead_process_log

NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def initial_model(cfg: Config, run_dir: Path, server: str = "vllm") -> str:
    """An HF directory the `server` servers ("vllm" or "sglang") start from, in the format of the versions they will
    load: model.path, or model.arch built and saved under the run dir (`<server>-initial-model`); for a low-bit
    rollout.weights_format, that checkpoint converted (`weights.convert`) under the run dir
    (`<server>-initial-model-<format>`), unless model.path is in that format already. An fp8 block the server cannot
    serve for the model (`models.fp8_run.block`, as the learner resolves it) is refused here, before any server
    starts."""
    name = NAMES[server]
    from offpolicy.models import fp8_run
    from offpolicy.weights.formats import NATIVE, checkpoint_format

    fmt = cfg.rollout.weights_format
    native = cfg.model.path
    if native is None:
        native = str(run_dir / f"{server}-initial-model")
        if not (Path(native) / "config.json").exists():
            import torch

            from offpolicy.models.build import build_model

            build_model(cfg.model, torch.device("cpu")).save_pretrained(native)
    found = checkpoint_format(native)
    if found == "fp8" == fmt:  # an fp8 model.path: its block must be one the server serves and the versions' block
        theirs = fp8_run.block(cfg, json.loads((Path(native) / "config.json").read_text())
                               ["quantization_config"].get("weight_block_size", (128, 128)), native)
        if theirs != (ours := fp8_run.block(cfg, path=native)):
            raise ValueError(f"model.path {native} is fp8 in {list(theirs)} blocks, but the versions will be written "
                             f"in {list(ours)} blocks (weights.fp8_block_size={cfg.weights.fp8_block_size}); vLLM "
                             f"builds its scales from the checkpoint it starts with: set "
                             f"weights.fp8_block_size={list(theirs)}")
    if found in (None, fmt):  # a hub id (the server reads it) or the versions' own format
        return native
    if found != NATIVE:
        raise ValueError(f"model.path {native} is a {found} checkpoint, but rollout.weights_format={fmt}: {name} takes "
                         "its quantization from the checkpoint it starts with, so versions of another format would not "
                         f"load; give model.path a {'bf16' if fmt == NATIVE else 'native'} copy of the model (e.g. "
                         f"benchmarks/startup.py --make DIR --format bf16), or set rollout.weights_format={found}")
    out = run_dir / f"{server}-initial-model-{fmt}"
    block = fp8_run.block(cfg, path=native) if fmt == "fp8" else (128, 128)
    if out.exists() and fmt == "fp8":  # made by an earlier start: its block must be the one the versions use
        made = json.loads((out / "config.json").read_text())["quantization_config"].get("weight_block_size")
        if made is not None and tuple(made) != block:
            shutil.rmtree(out)
    if not (out / "config.json").exists():
        from offpolicy.weights.convert import convert

        print(f"{name} starts from a {fmt} checkpoint: converting {native} into {out}", flush=True)
        convert(native, out, fmt, block, cfg.weights.fp8_skip)
    return str(out)


def _named(proc: subprocess.Popen) -> str:
    """The server a command started, for its errors: its module (`-m X`) or program."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, (list, tuple)) else str(proc.args).split()
    return args[args.index("-m") + 1] if "-m" in args[:-1] else Path(args[0]).name if args else "?"


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float,
                 field: str = "rollout.vllm.startup_timeout_s") -> None:
    """Wait for a server this process started to answer /health; fail at once if the process exits. `field`: the
    config field of `timeout`, for its error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server {_named(proc)} exited with {proc.returncode} before it was ready; {log}, "
                               f"{dead_process_log(Path(log).read_text(errors='replace'))}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server {_named(proc)} at {url} was not healthy in {timeout:.0f} s "
                       f"({field}); see {log}")
