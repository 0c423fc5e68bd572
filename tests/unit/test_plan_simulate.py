"""offpolicy/plan/simulate.py against closed forms: constant part times give the step by hand.

Staleness 0: the learner waits for the whole batch, so a step is load + generation + train +
publish (+ relay on a remote node). Staleness 1: generation of the next batch overlaps training, so
a step is max(load + generation, train + publish). The hub's admission rules (admission.py) run
unchanged, so the staleness bound and the prompt accounting hold whatever the times.
"""

from __future__ import annotations

import pytest

from offpolicy.plan.simulate import PipelineModel, ServerModel, simulate


def const(gen: float, tokens: int = 100):
    return lambda rng, groups: (gen, [tokens] * groups)


def model(s: int, gen=0.5, train=0.1, publish=0.2, load=0.0, servers=1, lease=8, batch=8, node=0, relay=0.0,
          shared=False, **kw) -> PipelineModel:
    names = ["gpu"] if shared else [f"r{i}" for i in range(servers)]
    srv = tuple(ServerModel(const(gen), names[0 if shared else i], node, load) for i in range(servers))
    res = {n: 1.0 for n in names} | ({} if shared else {"learner": 1.0})
    return PipelineModel(batch, s, srv, lambda t: train, publish, res, ("gpu",) if shared else ("learner",),
                         groups_per_lease=lease, relay_s=lambda hop: relay if hop else 0.0, **kw)


def step(m: PipelineModel, steps: int = 16, warmup: int = 4) -> dict:
    return simulate(m, steps).summary(warmup)


@pytest.mark.parametrize("load", [0.0, 0.05])
def test_staleness_0_step_is_the_sum_of_the_parts(load):
    r = step(model(0, load=load))
    assert r["step_s"] == pytest.approx(0.5 + 0.1 + 0.2 + load)
    assert r["tokens_per_s"] == pytest.approx(8 * 100 / (0.8 + load))
    assert r["learner_idle"] == pytest.approx((0.5 + load) / (0.8 + load))
    assert r["staleness_mean"] == 0


@pytest.mark.parametrize("gen, train, publish, load, expected", [
    (0.5, 0.1, 0.2, 0.0, 0.5),  # generation-bound
    (0.5, 0.1, 0.2, 0.05, 0.55),  # generation + the swap
    (0.2, 0.3, 0.2, 0.0, 0.5),  # learner-bound: train + publish
])
def test_staleness_1_step_is_the_longer_side(gen, train, publish, load, expected):
    r = step(model(1, gen, train, publish, load))
    assert r["step_s"] == pytest.approx(expected)
    assert r["staleness_mean"] == pytest.approx(1.0)


def test_two_servers_split_the_batch_at_staleness_0():
    # each server generates half the batch (a lease of 4 groups) in the same 0.5 s
    r = step(model(0, servers=2, lease=4))
    assert r["step_s"] == pytest.approx(0.8)
    assert r["rollout_idle"] == pytest.approx(0.3 / 0.8)


def test_a_remote_node_waits_for_the_relay():
    assert step(model(0, node=1, relay=0.3, load=0.05))["step_s"] == pytest.approx(0.5 + 0.1 + 0.2 + 0.3 + 0.05)
    # at staleness 1 a lease issued at an announcement needs that version (min_version = newest), so a
    # rollout waits for the relay before it starts: two steps hold one generation after the other's
    # train + publish + relay, 2P = gen + train + publish + relay (while that exceeds one generation)
    assert step(model(1, node=1, relay=0.3))["step_s"] == pytest.approx((0.5 + 0.1 + 0.2 + 0.3) / 2)
    assert step(model(1, node=1, relay=0.05))["step_s"] == pytest.approx(0.5)  # shorter: hidden


def test_learner_and_rollout_sharing_one_gpu_slow_each_other():
    # staleness 0 never overlaps them; at staleness 1 the 0.1 s of training runs beside generation at half
    # speed: the step is the generation's 0.5 s of work plus the 0.1 s it yields to training
    assert step(model(0, shared=True))["step_s"] == pytest.approx(0.8)
    assert step(model(1, shared=True))["step_s"] == pytest.approx(0.6)


def test_a_slow_server_is_dropped_stale_and_the_bound_holds():
    fast = ServerModel(const(0.1), "a")
    slow = ServerModel(const(5.0), "b")
    m = PipelineModel(4, 1, (fast, slow), lambda t: 0.05, 0.05, {"a": 1.0, "b": 1.0, "learner": 1.0}, ("learner",),
                      groups_per_lease=2)
    res = simulate(m, 60)
    assert res.dropped_stale > 0
    assert all(s <= 1 for r in res.steps for s in r.staleness)


def test_summary_needs_more_steps_than_the_warmup():
    with pytest.raises(ValueError, match="need more"):
        simulate(model(0), 3).summary(3)
