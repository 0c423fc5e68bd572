"""offpolicy/rollout/engines/http_pool.py against a real HTTP server on a local port: a daemon that stops cuts its
generate calls in flight (the server sees its client go away, as vLLM and SGLang then abort the request), marks no
server down, and refuses later generates at once."""

from __future__ import annotations

import http.server
import select
import threading
import time
import types

import pytest

from offpolicy.rollout.engines.errors import Stopped
from offpolicy.rollout.engines.http_pool import ServerPool


class SlowHandler(http.server.BaseHTTPRequestHandler):
    """/generate answers after 30 s unless its client goes away first (then it records that, as a server aborts)."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.arrived.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable and not self.connection.recv(1, 2):  # MSG_PEEK: b"" = the client closed its side
                self.server.gone.set()
                return
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Pool(ServerPool):
    name = "test"

    def generate_on(self, server, rows, sampling):
        return [self.call_object(server, "POST", "/generate", {"rows": r}, timeout=60, cuttable=True) for r in rows]


@pytest.fixture
def slow_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    httpd.arrived, httpd.gone = threading.Event(), threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_a_cut_ends_the_generate_in_flight_and_the_server_sees_its_client_go(slow_server):
    pool = Pool(types.SimpleNamespace(urls=[f"http://127.0.0.1:{slow_server.server_address[1]}"],
                                      health_check_interval_s=10.0))
    pool.servers[0].healthy, pool.servers[0].version = True, 0
    outcome: dict = {}

    def generate():
        t0 = time.monotonic()
        try:
            pool.generate([[1, 2]], [{}], 1, 0)
        except Stopped as e:  # the daemon's clean stop, not a server down
            outcome["error"] = str(e)
        outcome["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=generate)
    t.start()
    assert slow_server.arrived.wait(10)
    pool.cut()
    t.join(10)
    assert not t.is_alive() and outcome["seconds"] < 10, outcome  # not the server's 30 s
    assert "cut: the daemon stops" in outcome["error"] and pool.servers[0].healthy  # no server marked down
    assert slow_server.gone.wait(5)  # the server saw its client go away (vLLM and SGLang abort such a request)
    with pytest.raises(Stopped, match="cut"):
        pool.generate([[3]], [{}], 1, 0)  # and refuses the next one at once
