"""ZeroMQ plumbing: sockets with our options, typed send/receive, uvloop, clean signal handling.

Every socket gets LINGER 0 (shutdown never hangs on unsent messages), send/receive high-water marks
(memory stays bounded; a full peer blocks or refuses instead of growing queues) and MAXMSGSIZE
(ZeroMQ drops a peer that sends an oversize message before we ever allocate it). ROUTER sockets are
ROUTER_MANDATORY, so a reply to a vanished rollout raises instead of vanishing silently.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from offpolicy import protocol
from offpolicy.config import TransportConfig

log = logging.getLogger("offpolicy.transport")


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def make_socket(ctx: zmq.asyncio.Context, kind: int, cfg: TransportConfig) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, cfg.hwm)
    sock.setsockopt(zmq.RCVHWM, cfg.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


async def send(sock: zmq.asyncio.Socket, msg: protocol.Message, *arrays, to: bytes | None = None) -> bool:
    """Send one message; False if it could not go out.

    To a ROUTER peer (`to` given) the send never waits: a peer that is gone (EHOSTUNREACH) or that
    does not read its replies until its queue hits the high-water mark (EAGAIN) loses that reply,
    with a log line, instead of stalling the hub for everyone. A DEALER/PUB send waits as usual.
    """
    frames = protocol.encode(msg, *arrays)
    if to is None:
        await sock.send_multipart(frames, copy=False)
        return True
    try:
        sock.send_multipart([to, *frames], flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        log.warning("peer %r is not reading (queue full); dropped %s", to, type(msg).__name__)
    except zmq.ZMQError as e:
        if e.errno != zmq.EHOSTUNREACH:
            raise
        log.warning("peer %r is gone; dropped %s", to, type(msg).__name__)
    return False


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop` (the daemon then drains and exits cleanly)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def run(main: Callable[[], Awaitable[int]]) -> int:
    """Run an async main on uvloop where available."""
    try:
        import uvloop
    except ImportError:  # not on this platform: the stdlib loop works the same, only slower
        return asyncio.run(main())
    return uvloop.run(main())
