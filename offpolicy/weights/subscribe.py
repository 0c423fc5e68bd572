"""The public subscribe API: follow a run's weight versions from any process on the node.

    from offpolicy.weights import subscribe
    for wv in subscribe("/dev/shm/offpolicy", "quickstart", announce="tcp://learner:5556"):
        model.load_state_dict(wv.tensors)        # copies out of zero-copy views on shared memory

News of a version comes from two sources, so nothing is missed: the learner's PUB announcements
(when `announce` is given) and a scan of the store directory (at start, so a late joiner begins with
the newest version, and whenever no announcement arrived for `poll_s`). Versions are yielded in
increasing order; with `latest_only` (default) a subscriber that fell behind jumps to the newest.
The previous version is released when the next one is yielded, unless `hold=True`, in which case the
caller closes each `WeightVersion` itself. Copy what you keep before a version is released: a learner on
a GPU recycles the files of released versions (`weights.reuse_files: auto`). Iteration ends on the learner's Goodbye, after `timeout_s`
without a new version, or when `stop` (a threading.Event) is set. With `curve` (an
`offpolicy.wire.keys.CurveClient`) the announcement socket authenticates to a learner running CurveZMQ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import zmq

from offpolicy.weights.store import list_versions, version_dir
from offpolicy.weights.version import ChecksumError, WeightVersion
from offpolicy.wire import protocol
from offpolicy.wire.keys import CurveClient, apply_client

log = logging.getLogger("offpolicy.weights")


def subscribe(root: str, run: str, *, announce: str | None = None, start: int = 0, latest_only: bool = True,
              poll_s: float = 0.5, timeout_s: float | None = None, verify: bool = False, hold: bool = False,
              stop: threading.Event | None = None, curve: CurveClient | None = None) -> Iterator[WeightVersion]:
    """Yield each new `WeightVersion` of `run` (>= start) as it is published; see the module doc."""
    ctx = zmq.Context.instance()
    sub = None
    if announce:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if curve is not None:  # the learner's PUB only talks to allowlisted keys (transport.curve)
            apply_client(sub, curve)
        sub.connect(announce)
    current: WeightVersion | None = None
    refused: set[int] = set()
    next_version, last_news = start, time.monotonic()
    try:
        while stop is None or not stop.is_set():
            target, ended = _newest_known(root, run, sub, poll_s)
            if target is not None and target >= next_version:
                candidates = [v for v in list_versions(root, run) if v >= next_version and v not in refused]
                for v in candidates[-1:] if latest_only else candidates:
                    wv = _open(root, run, v, verify, refused)
                    if wv is None:
                        continue  # collected before we could hold it, or refused: wait for a newer one
                    if current is not None and not hold:
                        current.close()
                    current, next_version, last_news = wv, v + 1, time.monotonic()
                    yield wv
            if ended:
                return
            if timeout_s is not None and time.monotonic() - last_news > timeout_s:
                return
    finally:
        if current is not None and not hold:
            current.close()
        if sub is not None:
            sub.close(0)


def _newest_known(root: str, run: str, sub, poll_s: float) -> tuple[int | None, bool]:
    """Newest version heard of (announcement or store scan) and whether the run has ended."""
    newest, ended = None, False
    if sub is not None and sub.poll(int(poll_s * 1000)):
        while sub.poll(0):
            try:
                msg, _ = protocol.decode(sub.recv_multipart())
            except protocol.ProtocolError:
                continue  # not ours to fix here; the daemons count these
            if isinstance(msg, protocol.WeightAnnouncement):
                newest = max(newest or -1, msg.version)
            elif isinstance(msg, protocol.Goodbye):
                ended = True
    elif sub is None:
        time.sleep(poll_s)
    versions = list_versions(root, run)
    if versions:
        newest = max(newest or -1, versions[-1])
    return newest, ended


def _open(root: str, run: str, version: int, verify: bool, refused: set[int]) -> WeightVersion | None:
    """Hold `version`, or None if it was collected meanwhile or fails its checksums (then it is skipped
    and the subscriber keeps its current version)."""
    try:
        return WeightVersion(version_dir(root, run, version), verify=verify)
    except FileNotFoundError:
        return None
    except ChecksumError as e:
        log.error("refused weight version %d, keeping the current one: %s", version, e)
        refused.add(version)
        return None
