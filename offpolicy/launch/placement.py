"""Where `offpolicy run` puts its processes: which daemons, with which arguments, GPUs and ports.

`placement` lists the daemons in start order (learner ranks, rollout daemons, the eval daemon) with each
one's extra arguments and environment; `ports_in_use` names the ports of the run that are taken now. Ports:
the learner's (transport.*, the Megatron rendezvous), each daemon's metrics port (metrics.port + 1 + i for
rollout i, the eval daemon after them, the launcher's own after that), and the vLLM or SGLang servers it launches
(`launched_servers`).
"""

from __future__ import annotations

import os

from offpolicy.config import Config
from offpolicy.rollout.engines.launch import NAMES as SERVER_ENGINES  # whose servers it launches (`<engine>-<i>`)


def launched_servers(cfg: Config) -> str | None:
    """The engine whose servers `offpolicy run` starts itself, one per rollout daemon ("vllm" or "sglang": its
    rollout.<engine>.mode is http and its urls empty), else None."""
    e = cfg.rollout.engine
    if e in SERVER_ENGINES and getattr(cfg.rollout, e).mode == "http" and not getattr(cfg.rollout, e).urls:
        return e
    return None


def is_server(name: str) -> bool:
    """Whether process `name` of a run is a server it launched (`vllm-<i>`, `sglang-<i>`)."""
    return name.split("-")[0] in SERVER_ENGINES


def ports_in_use(cfg: Config) -> list[str]:
    """`field=port` of the ports the run's daemons will bind that are taken now (learner rank 0's, incl.
    the Megatron rendezvous port, each daemon's metrics port, and the servers `offpolicy run` starts)."""
    from offpolicy.plumbing.preflight import busy_ports, learner_ports

    wanted = learner_ports(cfg)
    if cfg.metrics.port:
        for i in range(1, cfg.run.rollouts + 2 + (cfg.eval.every_versions > 0)):  # the last: the launcher's
            wanted[f"metrics.port (+{i})"] = (cfg.metrics.host, cfg.metrics.port + i)
    if engine := launched_servers(cfg):
        port = getattr(cfg.rollout, engine).server_port
        for i in range(cfg.run.rollouts):
            wanted[f"rollout.{engine}.server_port (+{i})" if i else f"rollout.{engine}.server_port"] = (
                "127.0.0.1", port + i)
    return busy_ports(wanted)


def visible_devices(gpus: list[int | str], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES naming `gpus` (ints, or strings such as "2,3"); with the launcher's own
    CUDA_VISIBLE_DEVICES `parent` set, the indices count within it."""
    wanted = [int(g) for entry in gpus for g in str(entry).split(",")]
    if parent is None:
        return ",".join(map(str, wanted))
    have = [d.strip() for d in parent.split(",") if d.strip()]
    missing = [g for g in wanted if g >= len(have)]
    if missing:
        raise ValueError(f"run.learner_gpus/run.rollout_gpus name GPU {missing[0]} but the launcher sees only "
                         f"{len(have)} (CUDA_VISIBLE_DEVICES={parent!r}): indices count within it")
    return ",".join(have[g] for g in wanted)


def placement(cfg: Config, environ: dict[str, str] | None = None) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """The daemons to start, in order: (name, module, extra arguments, environment additions)."""
    env = os.environ if environ is None else environ
    parent = env.get("CUDA_VISIBLE_DEVICES")
    daemons = []
    lg = cfg.run.learner_gpus
    learner_env = {"CUDA_VISIBLE_DEVICES": visible_devices(lg, parent)} if lg else {}
    ranks = len(lg) if lg and cfg.learner.backend == "megatron" else 1
    for r in range(ranks):
        rank_env = dict(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r)) if ranks > 1 else {}
        daemons.append(("learner" if r == 0 else f"learner-r{r}", "offpolicy.services.learner", [],
                        {**learner_env, **rank_env}))
    shares = sglang_shares(cfg)
    for i in range(cfg.run.rollouts):
        extra = [f"metrics.port={cfg.metrics.port + 1 + i}"] if cfg.metrics.port else []
        if shares:
            extra.append(f"rollout.sglang.urls=[{', '.join(shares[i])}]")
        rg = cfg.run.rollout_gpus
        gpu_env = {"CUDA_VISIBLE_DEVICES": visible_devices([rg[i % len(rg)]], parent)} if rg else {}
        daemons.append((f"rollout-{i}", "offpolicy.services.rollout", [*extra, "--index", str(i)], gpu_env))
    if cfg.eval.every_versions:  # the eval daemon: metrics port after the rollouts', GPUs eval.gpus
        extra = [f"metrics.port={cfg.metrics.port + 1 + cfg.run.rollouts}"] if cfg.metrics.port else []
        eg = cfg.eval.gpus
        daemons.append(("eval", "offpolicy.services.eval_daemon", extra,
                        {"CUDA_VISIBLE_DEVICES": visible_devices(eg, parent)} if eg else {}))
    return daemons


def sglang_shares(cfg: Config) -> list[list[str]] | None:
    """Each rollout daemon's SGLang servers under `offpolicy run` (one machine, several daemons, http mode):
    rollout.sglang.urls dealt out, server j to daemon j % run.rollouts, since a daemon's weight loads (and its
    switches in flight, which abort every running request) change the weights under every request on its servers.
    None where the daemons take the config's list as it is, or `offpolicy run` launches a server for each (no urls);
    ValueError where there are fewer servers than daemons."""
    r, n = cfg.rollout, cfg.run.rollouts
    if r.engine != "sglang" or r.sglang.mode != "http" or n <= 1 or not r.sglang.urls:
        return None
    if len(r.sglang.urls) < n:
        raise ValueError(f"rollout.sglang.urls lists {len(r.sglang.urls)} SGLang server(s) for run.rollouts={n} "
                         "rollout daemons: under `offpolicy run` each daemon drives servers of its own (one daemon's "
                         f"weight loads would change the weights under the others' requests): list at least {n} "
                         f"servers, or set run.rollouts={max(1, len(r.sglang.urls))}")
    return [r.sglang.urls[i::n] for i in range(n)]


def launcher_metrics_port(cfg: Config) -> int:
    """The launcher's own /metrics port (offpolicy_launcher_*): after every daemon's; 0 when metrics.port is off."""
    if not cfg.metrics.port:
        return 0
    return cfg.metrics.port + 1 + cfg.run.rollouts + (cfg.eval.every_versions > 0)
