"""offpolicy/plan/simulate.py against closed forms: constant part times give the step by hand.

Staleness 0: the learner waits for the whole batch, so a step is load + generation + train +
publish (+ relay on a remote node). Staleness 1: generation of the next batch overlaps training, so
a step is max(load + generation, train + publish) with the learner waiting for each write
(weights.overlap_publish false), and with the write in the background the longer of the learner's own
cycle (train + snapshot, or the write when it is longer: one version in flight) and half the chain
publish -> load -> generate -> train (the k + 1 bound of bench/pipeline.py `speedups`). The hub's
admission rules (admission.py) run unchanged, so the staleness bound and the prompt accounting hold
whatever the times.
"""

from __future__ import annotations

import pytest

from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate


def const(gen: float, tokens: int = 100):
    return lambda rng, groups: (gen, [tokens] * groups)


def model(s: int, gen=0.5, train=0.1, publish=0.2, load=0.0, servers=1, lease=8, batch=8, node=0, relay=0.0,
          shared=False, prefetch=False, swap=0.0, **kw) -> PipelineModel:
    names = ["gpu"] if shared else [f"r{i}" for i in range(servers)]
    srv = tuple(ServerModel(const(gen), names[0 if shared else i], node, load, prefetch, swap_s=swap)
                for i in range(servers))
    res = {n: 1.0 for n in names} | ({} if shared else {"learner": 1.0})
    return PipelineModel(batch, s, srv, lambda t: train, publish, res, ("gpu",) if shared else ("learner",),
                         groups_per_lease=lease, relay_s=lambda hop: relay if hop else 0.0, **kw)


def step(m: PipelineModel, steps: int = 16, warmup: int = 4) -> dict:
    return simulate(m, steps).summary(warmup)


@pytest.mark.parametrize("load", [0.0, 0.05])
@pytest.mark.parametrize("overlap", [False, True])
def test_staleness_0_step_is_the_sum_of_the_parts(load, overlap):
    r = step(model(0, load=load, overlap_publish=overlap))
    assert r["step_s"] == pytest.approx(0.5 + 0.1 + 0.2 + load)
    assert r["tokens_per_s"] == pytest.approx(8 * 100 / (0.8 + load))
    # waiting for the write is the learner's stall, or idle while it runs in the background
    assert r["learner_idle"] == pytest.approx((0.5 + load + 0.2 * overlap) / (0.8 + load))
    assert r["stall_s"] == pytest.approx(0.0 if overlap else 0.2)
    assert r["staleness_mean"] == 0


@pytest.mark.parametrize("gen, train, publish, load, expected", [
    (0.5, 0.1, 0.2, 0.0, 0.5),  # generation-bound
    (0.5, 0.1, 0.2, 0.05, 0.55),  # generation + the swap
    (0.2, 0.3, 0.2, 0.0, 0.5),  # learner-bound: train + publish
])
def test_staleness_1_step_is_the_longer_side_when_the_learner_waits_for_the_write(gen, train, publish, load,
                                                                                 expected):
    r = step(model(1, gen, train, publish, load, overlap_publish=False))
    assert r["step_s"] == pytest.approx(expected)
    assert r["staleness_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("gen, train, publish, kw, expected", [
    (0.1, 0.3, 0.05, {}, 0.3),  # the learner's train alone: the write hides behind the next step
    (0.1, 0.3, 0.05, {"stall_s": 0.02}, 0.32),  # + the snapshot
    (0.1, 0.3, 0.5, {}, 0.5),  # a write longer than a step: one version in flight, the write sets the pace
    (0.05, 0.3, 0.2, {"slowdown": 0.5}, 0.3 + 0.5 * 0.2),  # the step beside the write is 0.5 x 0.2 s longer
    (0.3, 0.3, 0.3, {}, (0.3 + 0.3 + 0.3) / 2),  # half the chain publish -> generate -> train
])
def test_staleness_1_with_the_write_in_the_background(gen, train, publish, kw, expected):
    r = step(model(1, gen, train, publish, **kw))
    assert r["step_s"] == pytest.approx(expected)
    if publish < train:  # (a longer write: the learner waits for it and for the batch, which follows it)
        assert r["stall_s"] == pytest.approx(kw.get("stall_s", 0.0))


def test_a_prefetched_load_hides_behind_generation_but_not_in_the_chain():
    # staleness 1: the next version is read while the rollout still generates with the one before: the swap is free
    assert step(model(1, 0.5, 0.1, 0.05, 0.2))["step_s"] == pytest.approx(0.7)
    assert step(model(1, 0.5, 0.1, 0.05, 0.2, prefetch=True))["step_s"] == pytest.approx(0.5)
    # staleness 0: the rollout waits for the version itself, so the whole read is on the chain
    assert step(model(0, 0.5, 0.1, 0.05, 0.2, prefetch=True))["step_s"] == pytest.approx(0.85)


def test_a_staged_load_hides_its_read_but_not_its_swap():
    # a server's staging (rollout.vllm.prefetch device): the read runs ahead, the swap into the server is a stall
    assert step(model(1, 0.5, 0.1, 0.05, 0.2, prefetch=True, swap=0.1))["step_s"] == pytest.approx(0.6)
    assert step(model(0, 0.5, 0.1, 0.05, 0.2, prefetch=True, swap=0.1))["step_s"] == pytest.approx(0.95)


def test_the_first_versions_take_the_fresh_page_times():
    fresh = model(0, 0.5, 0.1, 0.05, 0.0, fresh_versions=100, fresh_publish_s=0.3)
    assert step(fresh)["step_s"] == pytest.approx(0.9)
    assert step(model(0, 0.5, 0.1, 0.05, 0.0, fresh_versions=2, fresh_publish_s=0.3))["step_s"] == pytest.approx(0.65)
    srv = ServerModel(const(0.5), "r0", load_s=0.1, fresh_load_s=0.4)
    assert srv.load_of(3, 10) == 0.4 and srv.load_of(10, 10) == 0.1 and srv.load_of(3, 0) == 0.1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_staleness_runs_more_than_k_plus_1_times_as_fast_as_staleness_0(k):
    # every part equal: staleness 0 pays the chain, k = 1 half of it; k > 1 is then bound by generation + swap
    zero = step(model(0, 0.3, 0.3, 0.3, 0.3))["step_s"]
    assert zero == pytest.approx(1.2)
    r = step(model(k, 0.3, 0.3, 0.3, 0.3))
    assert zero / r["step_s"] <= k + 1 + 1e-9
    assert r["step_s"] == pytest.approx(0.6)


def test_two_servers_split_the_batch_at_staleness_0():
    # each server generates half the batch (a lease of 4 groups) in the same 0.5 s
    r = step(model(0, servers=2, lease=4))
    assert r["step_s"] == pytest.approx(0.8)
    assert r["rollout_idle"] == pytest.approx(0.3 / 0.8)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_remote_node_waits_for_the_relay(overlap):
    assert step(model(0, node=1, relay=0.3, load=0.05, overlap_publish=overlap))["step_s"] == pytest.approx(
        0.5 + 0.1 + 0.2 + 0.3 + 0.05)
    # at staleness 1 a lease issued at an announcement needs that version (min_version = newest), so a
    # rollout waits for the relay before it starts: two steps hold one generation after the other's
    # train + publish + relay, 2P = gen + train + publish + relay (while that exceeds one generation)
    assert step(model(1, node=1, relay=0.3, overlap_publish=overlap))["step_s"] == pytest.approx(
        (0.5 + 0.1 + 0.2 + 0.3) / 2)
    assert step(model(1, node=1, relay=0.05, overlap_publish=overlap))["step_s"] == pytest.approx(0.5)


def test_learner_and_rollout_sharing_one_gpu_slow_each_other():
    # staleness 0 never overlaps them; at staleness 1 the 0.1 s of training runs beside generation at half
    # speed: the step is the generation's 0.5 s of work plus the 0.1 s it yields to training
    assert step(model(0, shared=True))["step_s"] == pytest.approx(0.8)
    assert step(model(1, shared=True))["step_s"] == pytest.approx(0.6)


def test_a_slow_server_is_dropped_stale_and_the_bound_holds():
    fast = ServerModel(const(0.1), "a")
    slow = ServerModel(const(5.0), "b")
    m = PipelineModel(4, 1, (fast, slow), lambda t: 0.05, 0.05, {"a": 1.0, "b": 1.0, "learner": 1.0}, ("learner",),
                      groups_per_lease=2, overlap_publish=False)
    res = simulate(m, 60)
    assert res.dropped_stale > 0
    assert all(s <= 1 for r in res.steps for s in r.staleness)


def test_summary_needs_more_steps_than_the_warmup():
    with pytest.raises(ValueError, match="need more"):
        simulate(model(0), 3).summary(3)
