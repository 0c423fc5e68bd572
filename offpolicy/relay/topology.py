"""Where a relay sits: the node list, its own index, whom it pulls from, and config checks.

Relay `i` (0-based, in `relay.nodes` order or the Slurm node list) pulls from relay
`(i - 1) // fanout`; relay 0 pulls from the source, the learner-side shard server. With fanout 1 that
is a chain source -> 0 -> 1 -> ..., so the learner sends each byte once whatever the number of nodes.
A relay whose upstream goes silent re-attaches to the next one up: `upstreams(i)` lists the parent,
its parent, ..., and last the source, which is never skipped.

A learner on several nodes (`relay.sources`: two or more hosts, in the learner's node order) has a source
on each learner node, serving that node's part of every version; "the source" is then all of them:
relay 0 (and any relay that re-attaches that far) pulls each file from its node's source. A source finds
its own node in `relay.sources` as a relay finds its index (`source_index`).

Invariant: every relay reads the same node list (same config, same Slurm step), so all of them compute
the same tree without talking to each other. This module imports nothing heavy.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from collections.abc import Mapping

from offpolicy.config import Config, ConfigError, learner_host


def slurm_hosts(env: Mapping[str, str] = os.environ) -> list[str] | None:
    """The Slurm step's node list (else the job's), expanded by `scontrol show hostnames`; None outside Slurm."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                             text=True, timeout=30).stdout
    except FileNotFoundError:
        raise ConfigError(f"config field relay.nodes: is empty and SLURM_*_NODELIST={nodelist!r} needs "
                          "`scontrol` to expand; put Slurm's bin directory on PATH or list relay.nodes") from None
    except subprocess.CalledProcessError as e:
        raise ConfigError(f"config field relay.nodes: `scontrol show hostnames {nodelist}` failed: "
                          f"{e.stderr.strip()}; list relay.nodes instead") from None
    return [h for h in out.split() if h]


def source_host(cfg: Config) -> str:
    """The (first) learner node's source: relay.source, else relay.sources[0], else the learner host."""
    return cfg.relay.source or (cfg.relay.sources[0] if cfg.relay.sources else learner_host(cfg))


def source_hosts(cfg: Config) -> list[str]:
    """Every learner node's source in the learner's node order: relay.sources, else the one source."""
    return list(cfg.relay.sources) or [source_host(cfg)]


def source_index(cfg: Config, explicit: int | None = None, env: Mapping[str, str] = os.environ,
                 hostname: str | None = None) -> int | None:
    """The learner node whose part this source serves (--index, OFFPOLICY_RELAY_INDEX, else this host's place
    in relay.sources); None with one learner node: the source serves the whole store."""
    if len(cfg.relay.sources) < 2:
        return None
    try:
        return own_index(list(cfg.relay.sources), explicit, env, hostname, field="relay.sources")
    except ConfigError as e:
        raise ConfigError(f"config field relay.sources: {e} (a source on several learner nodes serves its own "
                          "node's part)") from None


def relay_hosts(cfg: Config, env: Mapping[str, str] = os.environ) -> list[str]:
    """Relay nodes in chain order: `relay.nodes`, else the Slurm node list without the source host."""
    if cfg.relay.nodes:
        return list(cfg.relay.nodes)
    hosts = slurm_hosts(env)
    if hosts is None:
        raise ConfigError("config field relay.nodes: is empty and no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is "
                          "set; list the relay hosts in chain order, e.g. relay.nodes=[node1,node2]")
    sources = source_hosts(cfg)
    return [h for h in hosts if not any(same_host(h, s) for s in sources)]


def same_host(a: str, b: str) -> bool:
    """Whether two entries name one host: equal, or host names with the same first label (node1 = node1.cluster)."""
    if a == b:
        return True
    for h in (a, b):
        try:
            ipaddress.ip_address(h)
            return False
        except ValueError:
            pass
    return a.split(".")[0] == b.split(".")[0]


def own_index(hosts: list[str], explicit: int | None = None, env: Mapping[str, str] = os.environ,
              hostname: str | None = None, field: str = "relay.nodes") -> int:
    """This relay's index: --index, else OFFPOLICY_RELAY_INDEX, else this host's place in `hosts` (`field`)."""
    if explicit is None and env.get("OFFPOLICY_RELAY_INDEX"):
        explicit = int(env["OFFPOLICY_RELAY_INDEX"])
    if explicit is not None:
        if not 0 <= explicit < len(hosts):
            raise ConfigError(f"relay index {explicit} is outside {field} ({len(hosts)} hosts); "
                              f"use 0..{len(hosts) - 1}")
        return explicit
    name = hostname or socket.gethostname()
    for i, h in enumerate(hosts):
        if h == name or h.split(".")[0] == name.split(".")[0]:
            return i
    raise ConfigError(f"this host {name!r} is not in {'the relay node list' if field == 'relay.nodes' else field} "
                      f"{hosts}; pass --index or set OFFPOLICY_RELAY_INDEX, or fix {field}")


def local_announce(cfg: Config, env: Mapping[str, str] = os.environ, hostname: str | None = None) -> str:
    """The PUB address of this node's relay, for the node's rollouts (`rollout.announce: relay`): loopback
    when the relay binds every interface (`relay.bind_host` 0.0.0.0, as under Slurm), `relay.bind_host`
    when it names one, else this host's entry in the relay node list (found as the relay finds its index)."""
    r = cfg.relay
    if r.bind_host in ("0.0.0.0", "*"):
        host = "127.0.0.1"
    elif r.bind_host:
        host = r.bind_host
    else:
        hosts = relay_hosts(cfg, env)
        try:
            host = hosts[own_index(hosts, env=env, hostname=hostname)]
        except ConfigError as e:
            raise ConfigError(f"config field rollout.announce: is relay, but {e}") from None
    return f"tcp://{bind_address(host) if host != '127.0.0.1' else host}:{r.announce_port}"


def parent(index: int, fanout: int) -> int:
    """The relay that relay `index` pulls from; -1 = the source."""
    return -1 if index == 0 else (index - 1) // fanout


def upstreams(index: int, fanout: int) -> list[int]:
    """Relay indices to pull from, nearest first, ending with -1 (the source)."""
    out = [parent(index, fanout)]
    while out[-1] != -1:
        out.append(parent(out[-1], fanout))
    return out


def bind_address(host: str) -> str:
    """An address ZeroMQ can bind: IPs and `*` as they are, `0.0.0.0` as `*`, host names resolved."""
    if host in ("*", "0.0.0.0"):
        return "*"
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


def check(cfg: Config) -> None:
    """Checks of the relay section that types alone cannot express; raises ConfigError (field and fix)."""
    r = cfg.relay

    def require(ok: bool, field: str, problem: str, fix: str) -> None:
        if not ok:
            raise ConfigError(f"config field relay.{field}: {problem}; {fix}")

    for name in ("port", "announce_port"):
        require(0 < getattr(r, name) < 65536, name, f"is {getattr(r, name)}", "use a TCP port in 1..65535")
    require(r.port != r.announce_port, "announce_port", "equals relay.port", "give the two sockets different ports")
    require(0 <= r.metrics_port < 65536, "metrics_port", f"is {r.metrics_port}", "use 0 (off) or a TCP port")
    require(r.fanout >= 1, "fanout", f"is {r.fanout}", "use 1 for a chain or k >= 2 for a k-ary tree")
    require(r.window >= 1, "window", f"is {r.window}", "keep at least 1 chunk request in flight, e.g. 8")
    require(64 * 1024 <= r.chunk_bytes <= cfg.transport.max_message_bytes - 65536, "chunk_bytes",
            f"is {r.chunk_bytes}", "use 64 KiB up to transport.max_message_bytes - 64 KiB, e.g. 4194304")
    require(r.peer_timeout_s >= 0.2, "peer_timeout_s", f"is {r.peer_timeout_s}", "use e.g. 5.0 seconds")
    require(r.linger_s >= 0, "linger_s", f"is {r.linger_s}", "use 0 to exit as soon as the run is over")
    require(len(set(r.nodes)) == len(r.nodes), "nodes", "lists a host twice", "list every relay host once")
    require(len(set(r.sources)) == len(r.sources), "sources", "lists a host twice",
            "list every learner node's host once, in the learner's node order")
    require(not (r.sources and r.source and r.source != r.sources[0]), "source",
            f"is {r.source!r} but relay.sources starts with {r.sources[0]!r}" if r.sources else "",
            "leave relay.source empty when relay.sources lists the learner nodes")
    overlap = sorted({s for s in r.sources if any(same_host(s, h) for h in r.nodes)})
    require(not overlap, "nodes", f"lists learner node(s) {overlap} of relay.sources",
            "relays run on the rollout nodes; list only those in relay.nodes")
