"""ZeroMQ plumbing: sockets with our options, typed send/receive, uvloop, clean signal handling.

Every socket gets LINGER 0 (shutdown never hangs on unsent messages), send/receive high-water marks
(memory stays bounded; a full peer blocks or refuses instead of growing queues) and MAXMSGSIZE
(ZeroMQ drops a peer that sends an oversize message before we ever allocate it). ROUTER sockets are
ROUTER_MANDATORY, so a reply to a vanished rollout raises instead of vanishing silently.

`receive` is every daemon's receive loop: it yields what is ready at once as one batch of decoded
messages (awaiting only when nothing is), and counts, logs and skips whatever does not decode.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import numpy as np

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from offpolicy.config import TransportConfig
from offpolicy.plumbing.logs import RateLimitedLog
from offpolicy.wire import protocol

log = logging.getLogger("offpolicy.transport")
_drops = RateLimitedLog(log)  # a peer that stops reading must not flood the log either


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def make_socket(ctx: zmq.asyncio.Context, kind: int, cfg: TransportConfig,
                max_bytes: int | None = None) -> zmq.asyncio.Socket:
    """A socket with our options; `max_bytes` overrides transport.max_message_bytes (MAXMSGSIZE)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, cfg.hwm)
    sock.setsockopt(zmq.RCVHWM, cfg.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes or cfg.max_message_bytes)
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
    # With NOBLOCK an asyncio socket's send is done at once; its outcome is the future's, not a raise.
    sent = sock.send_multipart([to, *frames], flags=zmq.NOBLOCK, copy=False)
    error = sent.exception() if isinstance(sent, asyncio.Future) else None
    if error is None:
        return True
    if isinstance(error, zmq.Again):
        _drops.warning("full", "peer %r is not reading (queue full); dropped %s", to, type(msg).__name__)
    elif isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
        _drops.warning("gone", "peer %r is gone; dropped %s", to, type(msg).__name__)
    else:
        raise error
    return False


@dataclass(slots=True)
class Received:
    """One decoded message; its arrays are views on the received frames (writable, no copy)."""

    msg: protocol.Message
    arrays: list[np.ndarray]
    sender: bytes | None = None  # the peer's identity on a ROUTER socket, else None


def reject_reason(error: protocol.ProtocolError) -> str:
    """The `offpolicy_messages_rejected_total{reason}` label (and `Error.code`) of an undecodable message."""
    return "protocol_version" if isinstance(error, protocol.ProtocolVersionError) else "bad_message"


async def receive(sock: zmq.asyncio.Socket, *, rejected, log: RateLimitedLog, source: str = "a peer",
                  on_reject: Callable[[bytes | None, str, protocol.ProtocolError], Awaitable[None]] | None = None,
                  max_batch: int = 256) -> AsyncIterator[list[Received]]:
    """Decoded messages of `sock` (ROUTER: with the sender's identity), in batches, forever.

    Each batch is every message that was ready (up to `max_batch`): one await when the socket is
    empty, then non-blocking receives, so a busy peer costs one event-loop wake-up per batch and
    not per message. Frames are received without a copy and the arrays stay views on them. A message
    that does not decode is counted in `rejected` (a Counter labelled by `reject_reason`), logged
    (rate-limited per reason), handed to `on_reject(sender, reason, error)` if given, and skipped:
    it never ends the loop. After a full batch the loop's other tasks get their turn.
    """
    router = sock.type == zmq.ROUTER
    direct = zmq.Socket.shadow(sock.underlying)  # the same socket, without a Future per receive
    while True:
        frames = await sock.recv_multipart(copy=False)
        batch: list[Received] = []
        taken = 0  # messages received in this batch, undecodable ones too (a flood of junk is bounded as well)
        while True:
            taken += 1
            sender = frames[0].bytes if router else None
            try:
                msg, arrays = protocol.decode(frames[1:] if router else frames)
            except protocol.ProtocolError as e:
                reason = reject_reason(e)
                rejected.labels(reason).inc()
                log.warning(reason, "rejected a message from %s%s: %s", source,
                            f" {sender!r}" if sender is not None else "", e)
                if on_reject is not None:
                    await on_reject(sender, reason, e)
            else:
                batch.append(Received(msg, arrays, sender))
            if taken >= max_batch:
                break
            try:
                frames = _recv_ready(direct)
            except zmq.Again:
                break
        if batch:
            yield batch
        if taken >= max_batch:  # more may be waiting: let the loop's other tasks run first
            await asyncio.sleep(0)


def _recv_ready(sock: zmq.Socket) -> list[zmq.Frame]:
    """One multipart message that is ready now (zmq.Again if none), without a copy. Leaner than
    recv_multipart, which asks the socket for RCVMORE after every frame: a frame knows it itself."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:  # the rest of a multipart message is there once its first frame is
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame)
    return frames


_EVENTS = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth_failed", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol_failed",
           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed", zmq.EVENT_DISCONNECTED: "disconnected",
           zmq.EVENT_ACCEPTED: "accepted"}


def monitor(sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    """A monitor of `sock`'s connection events, for `watch`. Make it before `sock` binds: events that
    happen before the monitor exists are lost (a peer refused then would go uncounted)."""
    mask = 0
    for event in _EVENTS:
        mask |= event
    return sock.get_monitor_socket(mask)


async def watch(sock: zmq.asyncio.Socket, mon: zmq.asyncio.Socket, on_event: Callable[[str, str], None]) -> None:
    """Report the connection events of `sock` that its monitor `mon` sees (refused handshakes, disconnects
    such as ZeroMQ's answer to an oversize message) as (event name, peer endpoint) until cancelled."""
    try:
        while True:
            info = parse_monitor_message(await mon.recv_multipart())
            on_event(_EVENTS.get(info["event"], str(info["event"])), info["endpoint"].decode(errors="replace"))
    finally:
        if not sock.closed:
            sock.disable_monitor()
        mon.close(0)


def install_stop_signals(stop: asyncio.Event, on_stop: Callable[[], None] | None = None) -> None:
    """SIGTERM and SIGINT set `stop` (the daemon then drains and exits cleanly); the first one also calls
    `on_stop` (e.g. arming the daemon's exit deadline, offpolicy/plumbing/lifetime.py)."""
    loop = asyncio.get_running_loop()

    def stop_requested() -> None:
        first = not stop.is_set()
        stop.set()
        if first and on_stop is not None:
            on_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested)


def run(main: Callable[[], Awaitable[int]]) -> int:
    """Run an async main on uvloop where available."""
    try:
        import uvloop
    except ImportError:  # not on this platform: the stdlib loop works the same, only slower
        return asyncio.run(main())
    return uvloop.run(main())
