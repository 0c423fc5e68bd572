"""The vLLM contenders of `offpolicy bench rollout --engines` (`rollout_engines`): `VLLMEngine` through the
RolloutEngine protocol, over HTTP against a server this bench launches, or with vllm.LLM in process.

Each setup returns (load, generate, info, after) for `rollout_engines.Contender`: `load(WeightVersion)`
returns the swap's seconds (the engine's pause / load / fingerprint proof / resume) and records its method
and proof; `generate()` returns the tokens of one batch. The server is launched with
`offpolicy.rollout.engines.vllm.launch.server_command` (the command `offpolicy run` uses), its output in
OUT/vllm-server.log, and stopped (its process group) when the bench's exit stack closes. `after`, for the
server, loads the versions again through a second engine with `rollout.vllm.verify=false`: the swap
without its proof. That engine's first load is a rebuild (the server holds a version it did not see
start: `rollout/engines/vllm/servers.py`), reported apart.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from offpolicy.bench.common import free_port, median, stop_group


def _tokens(groups) -> int:
    return sum(len(c.tokens) for g in groups for c in g)


def _recording(eng, records: list[dict]):
    """`eng.load`, keeping the method and proof of each swap (VLLMEngine.last_loads)."""
    def load(wv) -> float:
        seconds = eng.load(wv)
        records.append({k: eng.last_loads[-1][k] for k in ("method", "verified")})
        return seconds

    return load


def http(config, args, device, prompts, params, stack):
    from offpolicy.rollout.engines.launch import initial_model, wait_healthy
    from offpolicy.rollout.engines.vllm import VLLMEngine
    from offpolicy.rollout.engines.vllm.launch import (
        server_command,
        server_env,
        server_url,
    )

    port = free_port()
    common = ["rollout.engine=vllm", "rollout.vllm.mode=http", f"rollout.vllm.server_port={port}",
              f"rollout.vllm.urls=[http://127.0.0.1:{port}]"]
    cfg = config(*common)
    log = Path(args.out) / "vllm-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    cmd = server_command(cfg, initial_model(cfg, Path(tmp)), 0, on_cpu=device.type == "cpu")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **server_env()}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    stack.callback(stop_group, proc, 30)
    wait_healthy(server_url(cfg, 0), proc, log, cfg.rollout.vllm.startup_timeout_s)
    info = {"server_ready_seconds": time.perf_counter() - t0, "command": cmd, "swap_methods": []}
    eng = VLLMEngine(cfg, seed=0)
    stack.callback(eng.close)

    def after(paths: list[Path]) -> dict:
        from offpolicy.weights import WeightVersion

        eng.close()
        plain = VLLMEngine(config(*common, "rollout.vllm.verify=false"), seed=0)
        records: list[dict] = []
        load, seconds = _recording(plain, records), []
        try:
            for path in paths:
                with WeightVersion(path) as wv:
                    seconds.append(load(wv))
        finally:
            plain.close()
        return {"unverified": {"swap_seconds": median(seconds[1:]), "swaps": seconds[1:], "swap_methods": records[1:],
                               "first": {"seconds": seconds[0], **records[0]}}}

    return _recording(eng, info["swap_methods"]), lambda: _tokens(eng.generate(prompts, params)), info, after


def in_process(config, args, device, prompts, params, stack):
    from offpolicy.rollout.engines.vllm import VLLMEngine

    eng = VLLMEngine(config("rollout.engine=vllm", "rollout.vllm.mode=engine"), seed=0)  # starts at its first load
    stack.callback(eng.close)
    info: dict = {"swap_methods": []}
    return _recording(eng, info["swap_methods"]), lambda: _tokens(eng.generate(prompts, params)), info, None

