"""Free ports for daemons to listen on, picked outside the kernel's ephemeral range.

A port from `bind(("127.0.0.1", 0))` is one of the kernel's ephemeral ports (`ip_local_port_range`, 32768-60999 by
default), which every outgoing connection also draws its source port from: between picking such a port and a
daemon binding it, a connection of another process (a rollout's ZeroMQ connect retrying, a gloo rendezvous) can take
it, and the bind fails with "Address already in use" (a CI run under load, the Megatron learner's hub). `free_ports`
picks listening ports below that range instead, which no outgoing connection takes, each checked free by a bind, in
a per-process order that successive calls walk on, so that a process never hands the same port out twice while an
earlier caller has yet to bind it."""

from __future__ import annotations

import itertools
import os
import socket
import threading
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services' ports
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_lock = threading.Lock()
_cursor: itertools.count | None = None


def listening_range() -> tuple[int, int]:
    """[first, end) of the ports `free_ports` picks from: LOWEST up to the ephemeral range's first port (the whole
    1024-65535 span, less nothing, where the range leaves too few below it)."""
    try:
        first = int(RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # Linux's default
    return (LOWEST, first) if first - LOWEST >= 1000 else (1024, 65536)


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _walk(n: int, host: str, consecutive: bool) -> list[int]:
    """The next `n` free ports of this process's walk through `listening_range` (`consecutive`: p..p+n-1, the walk
    then past them)."""
    global _cursor
    first, end = listening_range()
    span = end - first
    with _lock:
        if _cursor is None:  # processes start at different places of the range
            _cursor = itertools.count(os.getpid() * 7919 % span)
        out: list[int] = []
        for _ in range(span):
            port = first + next(_cursor) % span
            if consecutive:
                block = list(range(port, port + n))
                if port + n <= end and all(_free(host, q) for q in block):
                    for _ in range(n - 1):
                        next(_cursor)
                    return block
            elif port not in out and _free(host, port):
                out.append(port)
                if len(out) == n:
                    return out
    raise RuntimeError(f"no {n} free{' consecutive' if consecutive else ''} ports on {host} in {first}..{end - 1}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now, below the ephemeral range (`listening_range`)."""
    return _walk(n, host, consecutive=False)


def free_block(n: int, host: str = "127.0.0.1") -> int:
    """The first port p of `n` consecutive free ports p..p+n-1 below the ephemeral range (a run's metrics.port, and
    metrics.port + 1 + i for its rollouts)."""
    return _walk(n, host, consecutive=True)[0]
