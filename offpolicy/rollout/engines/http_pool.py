"""The inference servers one rollout daemon drives over HTTP: health, load balancing, weight swaps.

`ServerPool` is what SGLang's and vLLM's server pools share; each subclass says how its servers are
probed (`health_path`), checked at start (`check`), asked to generate (`generate_on`) and swapped to
a version (`update_on`). Plain JSON over `http.client` (standard library; one connection per call,
a thread per server). Invariants:
- every server carries the weight version it last loaded through us (-1: as launched; None:
  unknown, after a failed or missed update); `generate` sends work only to healthy servers on the
  version asked for, whole prompt groups to the least-loaded one, so a group shares a prefix cache;
- a server that fails a call (connection error, timeout, 5xx) is marked down and its rows go to
  the others within the same call; a 4xx is the request's fault and raises `RequestRefused`;
- a server marked down is probed again after `health_check_interval_s`, at the next weight swap
  (or `until_a_server`, which waits for one when every server is down); it serves again only once it has loaded the
  engine's version;
- `cut()` (the daemon stops) shuts the connections of the generate calls in flight, so that their threads end at
  once and the servers abort those requests (vLLM and SGLang abort a request whose client went away), instead of the
  daemon's exit deadline cutting them 3 s later with the servers still generating; a generate then raises
  `Stopped` saying so (the daemon's clean exit, not a failure), marking no server down. Weight swaps are never cut (a server left paused or half
  loaded would serve the next run so).
The servers must read the weight store's path: run them on the daemon's node.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from offpolicy.rollout.engines import sent_samples_first
from offpolicy.rollout.engines.errors import RequestRefused, ServerUnavailable, Stopped, WeightUpdateError

log = logging.getLogger("offpolicy.servers")

HEALTH_TIMEOUT_S = 30.0  # SGLang's /health_generate itself waits up to 20 s


class ServerDown(Exception):
    """A server did not answer a call properly (connection, timeout, 5xx); it is marked down."""


@dataclass
class Server:
    url: str
    healthy: bool = False
    version: int | None = -1  # weight version loaded through us; -1 = as launched; None = unknown
    checked_at: float = float("-inf")  # monotonic time of the last health probe
    inflight: int = 0  # rows sent and not yet answered
    state: dict = field(default_factory=dict)  # what a subclass keeps per server (vLLM: its fingerprint offset)


def error_message(body: bytes) -> str:
    """The human part of an error body: {"error": {"message"}}, {"message"}, {"detail"} or text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)[:500]


class ServerPool:
    name = "inference"  # the servers' kind in messages ("SGLang", "vLLM")
    health_path = "/health"
    section = "rollout"  # the config section named in messages (rollout.sglang, rollout.vllm)
    quiet_probes = False  # probes of servers marked down log nothing while they stay down

    def __init__(self, cfg: Any):
        self.cfg = cfg  # urls, startup_timeout_s, health_check_interval_s, request_timeout_s (+ the subclass's)
        if not cfg.urls:
            raise ValueError(f"{self.section}.urls is empty: list the {self.name} servers this rollout daemon drives, "
                             "e.g. [http://127.0.0.1:30000], or start the run with `offpolicy run`, which launches "
                             "one per daemon when the urls are empty")
        self.servers = [Server(u.rstrip("/")) for u in cfg.urls]
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.servers)), thread_name_prefix="engine-http")
        self._switches: ThreadPoolExecutor | None = None  # updates in flight (`update_weights(in_flight=True)`)
        self._cut = False  # set by cut(): generate calls end at once
        self._open: set[http.client.HTTPConnection] = set()  # the generate calls' connections in flight

    # --- plain calls ---------------------------------------------------------------------------------

    def call(self, server: Server, method: str, path: str, body: Any = None, timeout: float = 60.0,
             cuttable: bool = False) -> Any:
        """One JSON call; returns the decoded body (or text). Raises ServerDown or RequestRefused. A `cuttable` call
        (a generate) ends when `cut()` is called."""
        parts = urlsplit(server.url)
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            if cuttable:
                self._opened(conn)
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut short
            raise ServerDown(f"{server.url}{path}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
            if cuttable:
                with self._lock:
                    self._open.discard(conn)
        if resp.status >= 500:
            raise ServerDown(f"{server.url}{path}: HTTP {resp.status}: {error_message(raw)}")
        if resp.status >= 400:
            raise RequestRefused(server.url, path, resp.status, error_message(raw))
        if "json" not in (resp.getheader("Content-Type") or ""):
            return raw.decode(errors="replace")
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise ServerDown(f"{server.url}{path}: answered HTTP {resp.status} with a body that is not JSON") from None

    def _opened(self, conn: http.client.HTTPConnection) -> None:
        """Connect a cuttable call's connection, known to `cut()` from before it connects: a cut before the socket
        exists is seen after the connect, one after it shuts the socket."""
        with self._lock:
            if self._cut:
                raise OSError("the daemon stops (cut)")
            self._open.add(conn)
        conn.connect()
        with self._lock:
            if self._cut:
                raise OSError("the daemon stops (cut)")

    def cut(self) -> None:
        """The daemon stops: end every generate call in flight now and refuse new ones (the module doc)."""
        with self._lock:
            self._cut = True
            socks = [c.sock for c in self._open if c.sock is not None]
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass

    def call_object(self, server: Server, method: str, path: str, body: Any = None, timeout: float = 60.0,
                    cuttable: bool = False) -> dict:
        """`call` for endpoints that answer a JSON object."""
        answer = self.call(server, method, path, body, timeout, cuttable)
        if not isinstance(answer, dict):
            raise ServerDown(f"{server.url}{path}: answered {str(answer)[:200]!r}, not a JSON object")
        return answer

    def probe(self, server: Server, quiet: bool = False) -> bool:
        """GET the health path: 200 means the server generates; anything else marks it down."""
        server.checked_at = time.monotonic()
        try:
            self.call(server, "GET", self.health_path, timeout=HEALTH_TIMEOUT_S)
        except (ServerDown, RequestRefused) as e:
            server.healthy = False
            if not quiet:
                log.warning("%s server %s is not healthy: %s", self.name, server.url, e)
            return False
        server.healthy = True
        return True

    # --- start --------------------------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Wait up to startup_timeout_s for every server's health path, then run `check` on each."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = list(self.servers)
        log.info("waiting up to %s.startup_timeout_s=%.0f s for %s server(s) %s", self.section,
                 self.cfg.startup_timeout_s, self.name, ", ".join(s.url for s in self.servers))
        while waiting and time.monotonic() < deadline:
            waiting = [s for s in waiting if not self.probe(s, quiet=True)]
            if waiting:
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        for s in waiting:
            log.warning("%s server %s is not up yet; it is probed again at the next weight swap", self.name, s.url)
        for s in [s for s in self.servers if s.healthy]:
            try:
                self.check(s)
            except ServerDown as e:
                s.healthy = False
                log.warning("%s server %s failed its start-up checks, marked down: %s", self.name, s.url, e)
        if not any(s.healthy for s in self.servers):
            raise ServerUnavailable(f"no {self.name} server of {self.section}.urls {self.cfg.urls} answered "
                                    f"{self.health_path} within {self.section}.startup_timeout_s="
                                    f"{self.cfg.startup_timeout_s:.0f}: are they running on this node, on those ports?")

    def check(self, s: Server) -> None:
        """Start-up checks of one healthy server (a subclass's); raise ServerDown or an EngineError."""

    # --- generation ---------------------------------------------------------------------------------

    def generate(self, rows: list[list[int]], sampling: list[dict], group: int, version: int) -> list[dict]:
        """One output per row, in row order. Rows come in groups of `group` consecutive rows (a prompt's
        samples), each group sent whole to one server on `version`."""
        groups = [list(range(i, min(i + group, len(rows)))) for i in range(0, len(rows), group)]
        results: list[dict | None] = [None] * len(rows)
        while groups:
            usable = [s for s in self.servers if s.healthy and s.version == version]
            if not usable:
                raise ServerUnavailable(self._why_unusable(version))
            plan = self._assign(groups, usable)
            futures = [(s, idx, self._pool.submit(self._counted, s, idx, rows, sampling, group)) for s, idx in plan]
            groups = []
            for server, idx, future in futures:
                try:
                    outs = future.result()
                except ServerDown as e:
                    if self._cut:  # the daemon stops: no server is down
                        raise Stopped(f"the {self.name} generate calls were cut: the daemon stops") from None
                    server.healthy = False
                    log.warning("%s server %s failed a generate of %d rows, marked down; sending them to the "
                                "others: %s", self.name, server.url, len(idx), e)
                    groups += [idx[i:i + group] for i in range(0, len(idx), group)]
                    continue
                for i, out in zip(idx, outs):
                    results[i] = out
        return results  # type: ignore[return-value]  # every row was answered or the loop raised

    def _assign(self, groups: list[list[int]], usable: list[Server]) -> list[tuple[Server, list[int]]]:
        """Each group to the server with the fewest rows in flight (this call's included)."""
        load = {id(s): s.inflight for s in usable}
        plan: dict[int, list[int]] = {id(s): [] for s in usable}
        for g in groups:
            s = min(usable, key=lambda s: load[id(s)])
            plan[id(s)] += g
            load[id(s)] += len(g)
        return [(s, plan[id(s)]) for s in usable if plan[id(s)]]

    def _counted(self, server: Server, idx: list[int], rows: list[list[int]], sampling: list[dict],
                 group: int) -> list[dict]:
        with self._lock:
            server.inflight += len(idx)
        try:  # whole groups: each prompt's first sample sent first (`samples_first`: they share its prefill)
            outs = sent_samples_first(lambda r, sp: self.generate_on(server, r, sp), [rows[i] for i in idx],
                                      [sampling[i] for i in idx], group)
        finally:
            with self._lock:
                server.inflight -= len(idx)
        if not isinstance(outs, list) or len(outs) != len(idx) or not all(isinstance(o, dict) for o in outs):
            raise ServerDown(f"{server.url}: answered {type(outs).__name__} for a batch of {len(idx)} rows")
        return outs

    def generate_on(self, server: Server, rows: list[list[int]], sampling: list[dict]) -> list[dict]:
        """One output dict per row from one server (a subclass's); raises ServerDown or RequestRefused."""
        raise NotImplementedError

    def _why_unusable(self, version: int) -> str:
        states = ", ".join(f"{s.url} ({'up' if s.healthy else 'down'}, version {s.version})" for s in self.servers)
        return (f"no {self.name} server is up on weight version {version}: {states}; servers that were down come "
                f"back at the next weight swap once {self.health_path} answers")

    # --- weight swaps -------------------------------------------------------------------------------

    def probe_down(self, force: bool = False) -> None:
        """Probe the servers marked down whose last probe is older than health_check_interval_s."""
        now = time.monotonic()
        for s in self.servers:
            if not s.healthy and (force or now - s.checked_at >= self.cfg.health_check_interval_s):
                if self.probe(s, quiet=self.quiet_probes):
                    s.version = None  # a new process (a restart), or weights we no longer know: it serves again only
                    self.revived(s)  # once a load brings it to the engine's version

    def revived(self, s: Server) -> None:
        """A server marked down answered its probe again (a subclass's checks; it may mark it down again)."""

    def until_a_server(self, call: Callable[[], Any], stopping: threading.Event,
                       loaded: Callable[[], tuple[int, str | None]]) -> Any:
        """`call()`; with no server on the engine's version, bring those that are up to it (`loaded()`: its number and
        directory now, which a switch in flight may have moved during `call`) and call again at once; with every server
        down (killed mid-generate or mid-swap, restarted by `offpolicy run`), wait up to <section>.recover_timeout_s
        for one to come back (a server that goes down while it is brought to the version is waited for too), bring it
        to the version, and call again. Raises `Stopped` once `stopping` is set (the daemon stops), a refused load's
        WeightUpdateError, and the last ServerUnavailable past the timeout."""
        timeout = self.cfg.recover_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call()
            except ServerUnavailable as e:
                if stopping.is_set():
                    raise Stopped(f"the daemon stops while no {self.name} server takes work: {e}") from e
                try:
                    if self._bring_back(*loaded()):  # up, on no version or another (a refused load): no wait
                        continue
                except ServerUnavailable as lost:  # it went down during that load: waited for as any other
                    e = lost
                if time.monotonic() > deadline:
                    raise e
                log.warning("%s; waiting up to %s.recover_timeout_s=%.0f s for a server", e, self.section, timeout)
                if stopping.wait(min(self.cfg.health_check_interval_s, max(0.0, deadline - time.monotonic()))):
                    raise Stopped(f"the daemon stopped the wait for a {self.name} server: {e}") from e
                self.probe_down(force=True)
                with contextlib.suppress(ServerUnavailable):  # down again during the load: the next call waits
                    self._bring_back(*loaded())

    def _bring_back(self, version: int, path: str | None) -> bool:
        """Load version `version` (at `path`) onto the servers that are up on another; whether there were any."""
        back = [s for s in self.servers if s.healthy and s.version != version]
        if not back or path is None or version < 0:
            return False
        self.update_weights(path, version, servers=back)
        return True

    def update_weights(self, path: str, version: int, servers: list[Server] | None = None,
                       in_flight: bool = False) -> None:
        """Swap every reachable server (or `servers`) to the version at `path` (`update_on`; `switch_on` with
        `in_flight`: during a generate call, whose requests go on with the new version). A refusal raises
        WeightUpdateError; unreachable servers are marked down and skipped."""
        if servers is None:
            self.probe_down()
            servers = self.servers
        targets = [s for s in servers if s.healthy]
        if not targets:
            raise ServerUnavailable(self._why_unusable(version))
        if in_flight:  # the generate call holds the pool's threads
            if self._switches is None:
                self._switches = ThreadPoolExecutor(max_workers=max(1, len(self.servers)), thread_name_prefix="switch")
            futures = [(s, self._switches.submit(self.switch_on, s, path, version)) for s in targets]
        else:
            futures = [(s, self._pool.submit(self.update_on, s, path, version)) for s in targets]
        refused = []
        for s, future in futures:
            try:
                future.result()
            except ServerDown as e:
                s.healthy, s.version = False, None
                log.warning("%s server %s failed during the swap to version %d, marked down: %s", self.name, s.url,
                            version, e)
            except (RequestRefused, WeightUpdateError) as e:
                s.version = None  # its weights are not known to be the old ones any more
                refused.append(f"{s.url}: {e}")
            else:
                s.version = version
        if refused:
            raise WeightUpdateError(f"{self.name} refused weight version {version} from {path}; the engine keeps its "
                                    "old version number, and these servers take no work until a load succeeds on "
                                    "them: " + "; ".join(refused))
        if not any(s.version == version for s in self.servers):
            raise ServerUnavailable(self._why_unusable(version))

    def update_on(self, server: Server, path: str, version: int) -> None:
        """Swap one server to the version at `path` (a subclass's); raises ServerDown, RequestRefused or
        WeightUpdateError."""
        raise NotImplementedError

    def switch_on(self, server: Server, path: str, version: int) -> None:
        """Swap one server to the version at `path` while its requests are in flight (a subclass's, where its server
        can: rollout.inflight_updates); raises as `update_on`."""
        raise NotImplementedError(f"{self.name} servers take no weight update in flight")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._switches is not None:
            self._switches.shutdown(wait=False, cancel_futures=True)
