"""vLLM or SGLang servers shared by the runs of one `offpolicy bench pipeline`: started once, used by every run.

Each run of the pipeline bench is `offpolicy run` in miniature, which launches a server per rollout daemon when
`rollout.<engine>.mode` is http with no urls (`launch.placement.launched_servers`). On a GPU a server takes minutes
to start (torch.compile, CUDA graphs) against seconds for the steps a run measures, so `shared_servers` starts those
servers once, the way the launcher would (`launch.launcher.rollout_servers`: the initial model in the versions'
format, the server command, each on its rollout daemon's GPUs, logs in `<dir>/shared-<engine>/<engine>-<i>.log`),
hands their URLs to every run (`Launcher(servers=...)`), and stops them at the end: SIGTERM to each server's process
group, SIGKILL after `GRACE_S`, then the shared memory vLLM's EngineCores left (`plumbing.segments`). A run after the
first finds the servers at the previous run's last version: a vLLM engine then rebuilds on its first load, which
defines the proof's baseline anew (docs/vllm.md), and an SGLang server's first load through the run measures the
fingerprint's baseline anew (docs/sglang.md), so every run's versions are still proven.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GRACE_S = 30.0  # SIGTERM to SIGKILL


@contextmanager
def shared_servers(overrides: list[str], run_dir: Path, share: bool = True) -> Iterator[list[str] | None]:
    """The URLs of the vLLM or SGLang servers every run of the bench uses, one per rollout daemon (None when the runs
    launch no servers, or `share` is False: each run then starts its own)."""
    from offpolicy.config import load_config
    from offpolicy.launch.placement import launched_servers

    cfg = load_config(None, [*overrides, f"run.dir={run_dir}"])
    engine = launched_servers(cfg)
    if not (share and engine):
        yield None
        return
    from offpolicy.launch.launcher import rollout_servers
    from offpolicy.rollout.engines.launch import wait_healthy

    d = Path(run_dir) / f"shared-{engine}"
    d.mkdir(parents=True, exist_ok=True)
    servers = rollout_servers(cfg, d)  # what the launcher would start
    timeout = getattr(cfg.rollout, engine).startup_timeout_s
    started, procs = time.time(), []
    try:
        for name, cmd, env, _ in servers:
            log = d / f"{name}.log"
            with open(log, "ab") as out:
                procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                               start_new_session=True), log))
        for (proc, log), (*_, url) in zip(procs, servers):
            wait_healthy(url, proc, log, timeout, f"rollout.{engine}.startup_timeout_s")
        yield [url for *_, url in servers]
    finally:
        stop([p for p, _ in procs], started)


def stop(procs: list[subprocess.Popen], started: float) -> None:
    """End the servers' process groups (`plumbing.lifetime.kill_groups`: SIGTERM, SIGKILL after GRACE_S to what is
    left of a group, an EngineCore that outlived its API server too) and remove the shared memory their EngineCores
    made since `started` that no live process maps."""
    if not procs:
        return
    from offpolicy.plumbing import segments
    from offpolicy.plumbing.lifetime import kill_groups

    kill_groups({proc.pid for proc in procs}, GRACE_S)  # each server leads its own session (start_new_session)
    for proc in procs:
        proc.wait()
    segments.remove_orphans(since=started)
