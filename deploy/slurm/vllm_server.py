"""One vLLM server of an offpolicy run, started from the run's config (the `vllm` step of offpolicy.sbatch).

    vllm_server.py --config C [overrides] --index I [--host H] [--print]

Runs exactly the server `offpolicy run` launches for rollout daemon I
(offpolicy.rollout.engines.vllm.launch.server_command): `python -m vllm.entrypoints.openai.api_server` with
the run's engine arguments as flags (rollout.vllm: tensor/data parallel size, memory, max length,
eager, dtype, quantization, extra), offpolicy's worker extension, the flags the node's vLLM needs
besides (`--enable-scale-out`, the tokens API, from vLLM 0.32 on), port rollout.vllm.server_port + I, and
the environment VLLM_SERVER_DEV_MODE=1 and OFFPOLICY_VLLM_CHECKABLE_WEIGHTS=1 added to this one. It replaces this process (exec), so Slurm's
signals reach vLLM itself. The server starts from model.path, or, for a model built from model.arch,
from <run dir>/vllm-initial-model, which the first server of the job builds (same seed: version 0's
weights) while the others wait on a lock. The rollout daemon of the same node talks to it at
rollout.vllm.urls=[http://127.0.0.1:<port>] (task.sh sets that). --print prints the command and exits.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import shlex
import sys

from offpolicy.config import Config, ConfigError, load_config


def check(cfg: Config, index: int) -> None:
    if cfg.rollout.engine != "vllm" or cfg.rollout.vllm.mode != "http":
        raise ConfigError(f"rollout.engine is {cfg.rollout.engine} (rollout.vllm.mode {cfg.rollout.vllm.mode}): a vLLM "
                          "server step needs rollout.engine=vllm and rollout.vllm.mode=http")
    if not 0 <= index < 65536 - cfg.rollout.vllm.server_port:
        raise ConfigError(f"--index {index}: port rollout.vllm.server_port + index is not a TCP port")


def initial_model(cfg: Config) -> str:
    """The HF directory the server starts from; a model.arch model is built, and a checkpoint of another format
    than the versions' (rollout.weights_format) converted, once per run dir, under a lock (`launch.initial_model`,
    which also refuses an fp8 block vLLM cannot serve for the model)."""
    from offpolicy.loggers.runlog import run_path
    from offpolicy.rollout.engines import launch

    if cfg.model.path is not None and cfg.rollout.weights_format == "native":
        return cfg.model.path
    run_dir = run_path(cfg).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".vllm-initial-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other servers of the job wait for the first one's save
        return launch.initial_model(cfg, run_dir)


def on_cpu(cfg: Config) -> bool:
    """vLLM runs on the CPU: rollout.device cpu, or auto on a node without CUDA (a named cuda device is taken
    at its word, so that --print on a login node shows the GPU server's flags)."""
    if cfg.rollout.device == "cpu":
        return True
    if cfg.rollout.device.startswith("cuda"):
        return False
    import torch

    return not torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm_server.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--index", type=int, required=True, help="the rollout daemon this server serves (its port offset)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on [127.0.0.1]; 0.0.0.0 lets Prometheus "
                   "on another host scrape /metrics (and opens vLLM's dev endpoints to the network)")
    p.add_argument("--print", action="store_true", help="print the command line and exit")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check(cfg, args.index)
    except ConfigError as e:
        print(f"vllm_server.py: error: {e}", file=sys.stderr)
        return 2
    if not args.print and importlib.util.find_spec("vllm") is None:
        print(f"vllm_server.py: error: vLLM is not installed for {sys.executable}; install it in the environment the "
              "job runs (GPU: vLLM's CUDA build; CPU: bash deploy/vllm/install-cpu.sh; docs/vllm.md)", file=sys.stderr)
        return 2
    from offpolicy.rollout.engines.vllm.launch import server_command, server_env

    cmd = server_command(cfg, initial_model(cfg), args.index, on_cpu(cfg), host=args.host)
    if args.print:
        print(shlex.join(cmd))
        return 0
    env = {**os.environ, **server_env()}
    node = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    print(f"vllm_server.py: server {args.index} on {node}, CUDA_VISIBLE_DEVICES="
          f"{env.get('CUDA_VISIBLE_DEVICES', '')}: {' '.join(f'{k}={v}' for k, v in server_env().items())} "
          f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
