"""offpolicy.plumbing.metrics.scrape and the pipeline benchmark's Scraper: a self-connect is no answer, a rollout
that misses a poll keeps its last figures."""

import socket

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from offpolicy.bench.common import free_port
from offpolicy.bench.pipeline import Scraper, _ports
from offpolicy.plumbing.ports import listening_range
from offpolicy.plumbing import metrics


def test_a_socket_connected_to_itself_is_detected():
    """TCP simultaneous open: a socket bound to port P that connects to P is connected to itself, which is what
    a connect to an unused ephemeral port can turn into (issue 25's BadStatusLine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())
        assert metrics.self_connected(s)
        with socket.socket() as listener, socket.socket() as c:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            c.connect(listener.getsockname())
            assert not metrics.self_connected(c)


def test_scrape_answers_none_until_a_server_listens_then_its_text():
    port = free_port()
    assert metrics.scrape(port, timeout=1) is None
    registry = CollectorRegistry()
    Counter("offpolicy_test_things_total", "things", registry=registry).inc(3)
    start_http_server(port, addr="127.0.0.1", registry=registry)
    text = metrics.scrape(port, timeout=5)
    assert text is not None and "offpolicy_test_things_total 3.0" in text


def test_scraper_keeps_each_rollouts_newest_figures():
    ports = [free_port(), free_port()]
    scraper = Scraper(ports)
    assert scraper.poll() is None  # nobody up yet
    for port, calls in zip(ports, (2, 5)):
        registry = CollectorRegistry()
        h = Histogram("offpolicy_generate_seconds", "generations", registry=registry)
        for _ in range(calls):
            h.observe(0.5)
        start_http_server(port, addr="127.0.0.1", registry=registry)
    total = scraper.poll(attempts=20)
    assert total["offpolicy_generate_seconds_count"] == 7 and total["offpolicy_generate_seconds_sum"] == 3.5
    scraper.ports = [*ports, free_port()]  # a third rollout that never answers: no sum yet
    assert scraper.poll() is None
    record = scraper.describe().split("; ")  # the error's account of each port
    assert "2 answers, 1 misses" in record[0] and "generate count 2.0" in record[0]
    assert "generate count 5.0" in record[1] and record[2].endswith("0 answers, 1 misses, last answer never")


def test_metrics_ports_lie_below_the_ephemeral_range():
    for _ in range(5):
        work, announce, base = _ports(2)
        assert base + 2 < listening_range()[1] and len({work, announce, base, base + 1, base + 2}) == 5
