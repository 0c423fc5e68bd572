"""One vLLM or SGLang server of an offpolicy run, started from the run's config (the server step of offpolicy.sbatch).

    server.py --config C [overrides] --index I [--host H] [--print]

Runs exactly the server `offpolicy run` launches for rollout daemon I, by rollout.engine:
- vllm (offpolicy.rollout.engines.vllm.launch.server_command): `python -m vllm.entrypoints.openai.api_server` with
  the run's engine arguments as flags (rollout.vllm: tensor/data parallel size, memory, max length, eager, dtype,
  quantization, extra), offpolicy's worker extension, the flags the node's vLLM needs besides
  (`--enable-scale-out`, the tokens API, from vLLM 0.32 on), port rollout.vllm.server_port + I, and the environment
  VLLM_SERVER_DEV_MODE=1 and OFFPOLICY_VLLM_CHECKABLE_WEIGHTS=1 added to this one;
- sglang (offpolicy.rollout.engines.sglang.launch.server_command): rollout.sglang.launch (default `python -m
  sglang.launch_server`) with the run's ServerArgs as flags (rollout.sglang: tp/ep/dp sizes, memory share, attention
  backend, quantization, offpolicy's weight loaders, extra; the seed rollout.seed + I), port
  rollout.sglang.server_port + I.
It replaces this process (exec), so Slurm's signals reach the server itself. The server starts from model.path, or,
for a model built from model.arch (or versions in another format than model.path's), from
<run dir>/<engine>-initial-model[-<format>], which the first server of the job makes (same seed: version 0's weights)
while the others wait on a lock. The rollout daemon of the same node talks to it at
rollout.<engine>.urls=[http://127.0.0.1:<port>] (task.sh sets that). --print prints the command and exits.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import shlex
import sys

from offpolicy.config import Config, ConfigError, load_config
from offpolicy.rollout.engines.launch import NAMES as ENGINES


def check(cfg: Config, index: int) -> str:
    """The engine whose server this is ("vllm" or "sglang"), or a ConfigError naming the field."""
    r = cfg.rollout
    if r.engine not in ENGINES or getattr(r, r.engine).mode != "http":
        mode = f" (rollout.{r.engine}.mode {getattr(r, r.engine).mode})" if r.engine in ENGINES else ""
        raise ConfigError(f"rollout.engine is {r.engine}{mode}: a server step needs rollout.engine=vllm or sglang "
                          f"with rollout.<engine>.mode=http")
    port = getattr(r, r.engine).server_port
    if not 0 <= index < 65536 - port:
        raise ConfigError(f"--index {index}: port rollout.{r.engine}.server_port + index is not a TCP port")
    return r.engine


def initial_model(cfg: Config, engine: str) -> str:
    """The HF directory the server starts from; a model.arch model is built, and a checkpoint of another format
    than the versions' (rollout.weights_format) converted, once per run dir, under a lock (`launch.initial_model`,
    which also refuses an fp8 block vLLM cannot serve for the model)."""
    from offpolicy.loggers.runlog import run_path
    from offpolicy.rollout.engines import launch

    if cfg.model.path is not None and cfg.rollout.weights_format == "native":
        return cfg.model.path
    run_dir = run_path(cfg).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / f".{engine}-initial-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other servers of the job wait for the first one's save
        return launch.initial_model(cfg, run_dir, engine)


def on_cpu(cfg: Config) -> bool:
    """vLLM runs on the CPU: rollout.device cpu, or auto on a node without CUDA (a named cuda device is taken
    at its word, so that --print on a login node shows the GPU server's flags)."""
    if cfg.rollout.device == "cpu":
        return True
    if cfg.rollout.device.startswith("cuda"):
        return False
    import torch

    return not torch.cuda.is_available()


def command(cfg: Config, engine: str, index: int, host: str) -> tuple[list[str], dict[str, str]]:
    """The server's command line and the environment it adds."""
    model = initial_model(cfg, engine)
    if engine == "sglang":
        from offpolicy.rollout.engines.sglang.launch import server_command as sglang_command

        return sglang_command(cfg, model, index, host=host), {}
    from offpolicy.rollout.engines.vllm.launch import server_command, server_env

    return server_command(cfg, model, index, on_cpu(cfg), host=host), server_env()


def missing(cfg: Config, engine: str) -> str | None:
    """Why the server cannot start from this interpreter (its engine not installed), or None."""
    if engine == "sglang" and cfg.rollout.sglang.launch:  # the user's own command runs it
        return None
    if importlib.util.find_spec(engine) is not None:
        return None
    how = ("GPU: vLLM's CUDA build; CPU: bash deploy/vllm/install-cpu.sh; docs/vllm.md" if engine == "vllm" else
           "pip install sglang (docs/sglang.md), or set rollout.sglang.launch to a command that runs it")
    return (f"{ENGINES[engine]} is not installed for {sys.executable}; install it in the environment the job runs "
            f"({how})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="server.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--index", type=int, required=True, help="the rollout daemon this server serves (its port offset)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on [127.0.0.1]; 0.0.0.0 lets Prometheus "
                   "on another host scrape /metrics (and opens the server's weight-update endpoints to the network)")
    p.add_argument("--print", action="store_true", help="print the command line and exit")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        engine = check(cfg, args.index)
    except ConfigError as e:
        print(f"server.py: error: {e}", file=sys.stderr)
        return 2
    if not args.print and (why := missing(cfg, engine)):
        print(f"server.py: error: {why}", file=sys.stderr)
        return 2
    cmd, added = command(cfg, engine, args.index, args.host)
    if args.print:
        print(shlex.join(cmd))
        return 0
    env = {**os.environ, **added}
    node = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    print(f"server.py: {ENGINES[engine]} server {args.index} on {node}, CUDA_VISIBLE_DEVICES="
          f"{env.get('CUDA_VISIBLE_DEVICES', '')}: {' '.join(f'{k}={v}' for k, v in added.items())} "
          f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
