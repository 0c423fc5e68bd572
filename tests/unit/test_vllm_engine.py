"""VLLMEngine's own logic with a stand-in backend (the real servers: tests/integration/test_vllm_engine.py):
waiting for a server killed mid-generate or mid-swap, aborted samples generated again, one completion per
sample in prompt order."""

from __future__ import annotations

import threading

import pytest

from offpolicy.config import load_config
from offpolicy.rollout.engines import SamplingParams
from offpolicy.rollout.engines.errors import RetriesExhausted, ServerUnavailable
from offpolicy.rollout.engines.http_pool import Server, ServerPool
from offpolicy.rollout.engines.vllm.engine import VLLMEngine

CONFIG = "configs/quickstart-vllm.yaml"


class Backend:
    """Answers like VLLMServers; `down` calls fail with ServerUnavailable first, `aborts` choices abort. The wait for
    a server is the real pool's (`ServerPool.until_a_server`)."""

    output_versions = True
    name, section = "vLLM", "rollout.vllm"
    until_a_server = ServerPool.until_a_server
    _bring_back = ServerPool._bring_back

    def __init__(self, down: int = 0, aborts: int = 0):
        self.down, self.aborts = down, aborts
        self.servers = [Server("http://127.0.0.1:1", healthy=True, version=-1)]
        self.swaps: list[dict] = []
        self.calls: list[tuple] = []

    def _fail(self):
        if self.down:
            self.down -= 1
            self.servers[0].healthy = False
            raise ServerUnavailable("no vLLM server is up")

    def probe_down(self, force=False):
        self.calls.append(("probe", force))
        if not self.down:
            self.servers[0].healthy, self.servers[0].version = True, -1  # back, as a new engine

    def update_weights(self, path, version, servers=None):
        self.calls.append(("update", path, version, servers is not None))
        self._fail()
        self.servers[0].version = version
        self.swaps.append({"url": self.servers[0].url, "method": "inplace", "verified": True, "seconds": 0.01})

    def generate(self, rows, sampling, group, version):
        self.calls.append(("generate", version))
        self.sampling = sampling
        self._fail()
        outs = []
        for row, sp in zip(rows, sampling):
            reason = "abort" if self.aborts else "stop"
            self.aborts = max(0, self.aborts - 1)
            outs.append({"choices": [{"index": i, "finish_reason": reason, "token_ids": [row[-1], 13],
                                      "logprobs": {"content": [{"token_id": row[-1], "logprob": -0.5},
                                                               {"token_id": 13, "logprob": -0.25}]},
                                      "weight_versions": [{"version": str(version), "start": 0, "end": 2}]}
                                     for i in range(sp["n"])]})
        return outs


class Version:
    def __init__(self, version):
        self.version, self.path = version, f"/store/v{version}"


def engine(backend, **overrides) -> VLLMEngine:
    cfg = load_config(CONFIG, ["rollout.vllm.health_check_interval_s=0.01", "rollout.vllm.recover_timeout_s=5",
                               *[f"rollout.vllm.{k}={v}" for k, v in overrides.items()]])
    e = VLLMEngine.__new__(VLLMEngine)  # the stand-in backend instead of servers
    e.cfg, e.v, e.stop_ids, e.version, e.path, e.aborted, e.backend = cfg, cfg.rollout.vllm, {13}, -1, None, 0, backend
    backend.cfg = cfg.rollout.vllm  # recover_timeout_s, health_check_interval_s
    e.last_loads, e.stopping, e.inflight = [], threading.Event(), False
    return e


def test_every_stop_id_of_the_model_is_sent_with_the_requests_own():
    """vLLM adds only its generation config's EOS ids (or config.json's where it has none): the engine sends all of
    `model_stop_ids` (here the tokenizer's 13 and a model EOS 7) and params.stop_token_ids."""
    e = engine(Backend())
    e.stop_ids = frozenset({13, 7})
    e.load(Version(3))
    e.generate([[11, 4, 12]], SamplingParams(n=2, max_new_tokens=4, stop_token_ids=(4,)))
    assert [sp["stop_token_ids"] for sp in e.backend.sampling] == [[4, 7, 13]]


def test_generate_returns_n_completions_per_prompt_of_the_engines_version():
    e = engine(Backend())
    e.load(Version(3))
    groups = e.generate([[11, 4, 12], [11, 7, 12]], SamplingParams(n=3, max_new_tokens=4))
    assert [[c.tokens.tolist() for c in g] for g in groups] == [[[12, 13]] * 3] * 2
    assert groups[0][0].finish_reason == "stop" and e.version == 3


def test_a_server_killed_mid_generate_is_waited_for_and_brought_to_the_version():
    b = Backend()
    e = engine(b)
    e.load(Version(3))
    b.down = 2  # the next two calls find no server
    groups = e.generate([[11, 4, 12]], SamplingParams(n=2))
    assert len(groups[0]) == 2
    assert ("update", "/store/v3", 3, True) in b.calls  # the restarted server got version 3 before generating


def test_a_server_killed_mid_swap_is_waited_for():
    b = Backend()
    e = engine(b)
    e.load(Version(3))
    b.down = 1
    e.load(Version(4))
    assert e.version == 4 and b.servers[0].version == 4


class Unloaded(Backend):
    """Generate finds no server on the engine's version while the one server is on another (up, on no version: a
    refused load, a server back as a new engine), as the real pool's does."""

    def generate(self, rows, sampling, group, version):
        if self.servers[0].version != version:
            self.calls.append(("generate", version))
            raise ServerUnavailable(f"no vLLM server is up on weight version {version}")
        return super().generate(rows, sampling, group, version)


def test_a_server_up_on_no_version_is_loaded_at_once_and_one_that_dies_in_that_load_is_waited_for():
    b = Unloaded()
    e = engine(b)
    e.load(Version(3))
    b.servers[0].version = None
    assert len(e.generate([[11, 4, 12]], SamplingParams(n=2))[0]) == 2
    assert ("probe", True) not in b.calls  # loaded at once: no wait for a server (the wait ends in a probe)
    b = Unloaded()
    e = engine(b)
    e.load(Version(3))
    b.servers[0].version, b.down = None, 1  # ... and it dies during the load that brings it back
    assert len(e.generate([[11, 4, 12]], SamplingParams(n=2))[0]) == 2
    assert b.calls.count(("update", "/store/v3", 3, True)) == 2 and ("probe", True) in b.calls
    assert b.servers[0].version == 3


def test_no_server_within_recover_timeout_raises():
    b = Backend(down=10**6)
    e = engine(b, recover_timeout_s=0.05)
    with pytest.raises(ServerUnavailable):
        e.load(Version(0))


def test_aborted_samples_are_generated_again_then_retries_run_out():
    b = Backend()
    e = engine(b, max_retries=1)
    e.load(Version(0))
    b.aborts = 1
    assert len(e.generate([[11, 4, 12]], SamplingParams(n=2))[0]) == 2 and e.aborted == 2
    b.aborts = 10
    with pytest.raises(RetriesExhausted):
        e.generate([[11, 4, 12]], SamplingParams(n=2))


def test_each_load_reports_its_records_and_a_long_run_keeps_none():
    b = Backend()
    e = engine(b)
    for v in range(100):
        e.load(Version(v))
        assert [r["method"] for r in e.last_loads] == ["inplace"]
    assert b.swaps == []  # nothing accumulates per version
    b.down = 2  # the server restarts mid-generate: it is brought back to version 99 there
    e.generate([[11, 4, 12]], SamplingParams(n=2))
    e.load(Version(100))  # that load is reported with the next one (the rollout counts every load)
    assert len(e.last_loads) == 2 and b.swaps == []


def test_auto_prefetch_stages_nothing_on_a_learner_gpu():
    """The workers' auto stages a version on their GPU where half its free memory holds it (staging.resolve); beside
    the learner that memory is the learner's to grow into, so the engine sends them direct there (nothing kept; its
    loads beside a training learner half hash's)."""
    from offpolicy.rollout.engines.vllm.engine import prefetch_setting

    base = ["run.learner_gpus=[0]", "rollout.device=auto"]  # the config's servers run on the CPU
    assert prefetch_setting(load_config(CONFIG, [*base, "run.rollout_gpus=[0]"])) == "direct"
    assert prefetch_setting(load_config(CONFIG, [*base, "run.rollout_gpus=['1,0']"])) == "direct"
    assert prefetch_setting(load_config(CONFIG, [*base, "run.rollout_gpus=[1]"])) == "auto"  # its own GPU
    assert prefetch_setting(load_config(CONFIG, [*base, "run.rollout_gpus=[0]", "rollout.vllm.prefetch=device"])) \
        == "device"  # an explicit setting is the user's
    assert prefetch_setting(load_config(CONFIG, [])) == "auto"  # GPUs inherited: nothing known
    assert prefetch_setting(load_config(CONFIG, [*base, "run.rollout_gpus=[0]", "rollout.device=cpu"])) == "auto"
