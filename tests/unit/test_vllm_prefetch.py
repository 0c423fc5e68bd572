"""offpolicy/rollout/engines/vllm/prefetch.py: the vLLM engine's prefetcher (`rollout.double_buffer` over HTTP)
against stand-in servers: who is asked to hash which version ahead, and what each request became."""

import threading
import types

from offpolicy.rollout.engines.vllm.prefetch import VLLMPrefetcher


class _Servers:
    def __init__(self, healthy=(True, True), refuse=False):
        self.cfg = types.SimpleNamespace(update_timeout_s=5.0, prefetch="host", stage_threads=3)
        self.servers = [types.SimpleNamespace(url=f"http://s{i}", healthy=h) for i, h in enumerate(healthy)]
        self.asked: list[tuple[str, str]] = []
        self.stages: list[str] = []  # rollout.vllm.prefetch, sent with each request
        self.maps = 5  # versions the workers keep registered for their reads (staging.map_versions)
        self.sent_maps: list[int] = []
        self.sent_threads: list[int] = []  # rollout.vllm.stage_threads, sent with each request
        self.refuse = refuse

    def rpc(self, s, method, kwargs, timeout):
        if self.refuse:
            raise ConnectionError("refused")
        self.asked.append((s.url, kwargs["path"]))
        self.stages.append(kwargs["stage"])
        self.sent_maps.append(kwargs["maps"])
        self.sent_threads.append(kwargs["threads"])
        return [{"path": kwargs["path"]}]


def _engine(servers):
    return types.SimpleNamespace(backend=servers, version=-1, last_loads=[], switched=[])


def _wv(v):
    return types.SimpleNamespace(version=v, path=f"/store/v{v}")


def _flush(p):
    p.asked(10)


def test_every_healthy_server_is_asked_once_per_version():
    servers = _Servers(healthy=(True, False))
    p = VLLMPrefetcher(_engine(servers))
    p.prefetch(_wv(3))
    _flush(p)
    p.prefetch(_wv(3))  # offered again after a load: asked already
    _flush(p)
    assert servers.asked == [("http://s0", "/store/v3")] and servers.stages == ["host"] and servers.sent_maps == [5]
    assert servers.sent_threads == [3]
    p.close()


def test_a_load_that_took_the_hash_is_swapped_and_older_requests_superseded():
    servers = _Servers()
    engine = _engine(servers)
    p = VLLMPrefetcher(engine)
    for v in (3, 4):
        p.prefetch(_wv(v))
        _flush(p)
    engine.version = 4
    engine.last_loads = [{"url": s.url, "prefetch": {"seconds": 2.0 + i, "began": 100.0 - i}}
                         for i, s in enumerate(servers.servers)]
    records = p.drain()
    assert [(r.version, r.outcome) for r in records] == [(3, "superseded"), (4, "swapped")]
    assert records[1].seconds == 3.0 and records[1].began == 99.0  # the slowest server, the earliest start
    assert p.drain() == []
    p.close()


def test_each_version_switched_to_in_flight_is_swapped_from_its_own_records():
    """rollout.inflight_updates: a generate call that switched to 4, then 5 reports both as swapped in flight, each
    with its own switch's seconds and proofs (once the newest only, 4 counted as superseded)."""
    servers = _Servers()
    engine = _engine(servers)
    p = VLLMPrefetcher(engine)
    for v in (3, 4, 5):
        p.prefetch(_wv(v))
        _flush(p)

    def loads(seconds, at):
        return [{"url": s.url, "method": "inplace", "verified": True, "seconds": seconds, "inflight_at": at,
                 "prefetch": {"seconds": 1.0, "began": at - 1.0}} for s in servers.servers]

    engine.switched[:] = [(4, loads(0.2, 10.0)), (5, loads(0.3, 20.0))]
    engine.version, engine.last_loads = 5, loads(0.3, 20.0)  # as the second switch's take_swaps left them
    records = p.drain()
    assert [(r.version, r.outcome, r.inflight) for r in records] == [(3, "superseded", False), (4, "swapped", True),
                                                                     (5, "swapped", True)]
    assert [(r.swapped_at, r.swap_seconds) for r in records[1:]] == [(10.0, 0.2), (20.0, 0.3)]
    assert records[2].proofs == (("inplace", True), ("inplace", True)) and engine.switched == []
    assert p.drain() == []
    p.close()


def test_a_load_that_hashed_its_own_files_is_not_counted_as_prefetched():
    servers = _Servers()
    engine = _engine(servers)
    p = VLLMPrefetcher(engine)
    p.prefetch(_wv(5))
    _flush(p)
    engine.version, engine.last_loads = 5, [{"url": "http://s0", "prefetch": {"seconds": 1.0, "began": 1.0}},
                                             {"url": "http://s1"}]  # one server restarted: no hash ahead there
    assert p.drain() == []
    p.close()


def test_a_refused_request_is_failed_and_a_request_replaced_before_it_was_sent_is_superseded():
    servers = _Servers(refuse=True)
    p = VLLMPrefetcher(_engine(servers))
    p.prefetch(_wv(1))
    _flush(p)
    assert [(r.version, r.outcome) for r in p.drain()] == [(1, "failed")]
    servers.refuse = False
    hold = threading.Event()
    p._pool.submit(hold.wait, 10)  # the prefetcher's thread is busy: requests wait
    p.prefetch(_wv(2))
    p.prefetch(_wv(3))  # replaces version 2 before it was sent
    hold.set()
    _flush(p)
    assert servers.asked == [("http://s0", "/store/v3"), ("http://s1", "/store/v3")]
    assert [(r.version, r.outcome) for r in p.drain()] == [(2, "superseded")]
    p.close()
