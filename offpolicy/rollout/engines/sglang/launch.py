"""The SGLang servers `offpolicy run` starts itself (rollout.sglang.mode http with no urls), one per rollout daemon.

`server_command` is rollout.sglang.launch (default: this interpreter's `python -m sglang.launch_server`) followed by
the run's SGLang server arguments as flags: the same ServerArgs the in-process engine is given
(`local.engine_kwargs`: the initial model, model.dtype, tp/ep/dp sizes, the seed rollout.seed + the daemon's index
unless rollout.sglang.random_seed is set, memory share, attention backend, quantization, offpolicy's custom weight
loaders, which the fingerprint proof needs, and rollout.sglang.extra), `--enable-deterministic-inference` with
rollout.seed_per_prompt (the daemon checks it through /server_info), and `--host` / `--port`
rollout.sglang.server_port + index. The server starts from `engines.launch.initial_model` (`sglang-initial-model` under
the run directory for a model built from model.arch). SGLang 0.5.14 derives a gRPC port of `--port` + 10000 and
refuses to start where that passes 65535, so the config checks keep server_port + run.rollouts within 55536.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from offpolicy.config import Config
from offpolicy.rollout.engines.sglang.local import engine_kwargs, server_args_fields

MODULE = "sglang.launch_server"


def server_url(cfg: Config, index: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{cfg.rollout.sglang.server_port + index}"


def cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """`sglang.launch_server` flags of ServerArgs fields: --name-with-dashes VALUE; True as a bare flag (SGLang's
    booleans are store_true), False and None left out (its defaults); a list as the flag and its items (nargs, e.g.
    --custom-weight-loader A B), a dict as JSON."""
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def server_command(cfg: Config, model: str, index: int, host: str = "127.0.0.1") -> list[str]:
    """The command line of SGLang server `index` (port rollout.sglang.server_port + index) on checkpoint `model`."""
    s = cfg.rollout.sglang
    # the installed ServerArgs' names matter only for attention data parallelism (renamed after 0.5.14); SGLang is
    # imported for them only then, and only when the server runs from this interpreter
    fields = server_args_fields() if s.attn_dp_size > 1 and not s.launch else None
    kw = engine_kwargs(cfg, cfg.rollout.seed + index, model_path=model, fields=fields)
    if s.attn_dp_size == 1:  # SGLang's default, and a flag 0.5.14's parser does not know
        kw.pop("attn_dp_size", None)
    if cfg.rollout.seed_per_prompt:
        kw["enable_deterministic_inference"] = True
    launch = list(s.launch) or [sys.executable, "-m", MODULE]
    return [*launch, *cli_flags(kw), "--host", host, "--port", str(s.server_port + index)]
