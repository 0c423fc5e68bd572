"""The restart policy (offpolicy/plumbing/restarts.py): a budget per process within a window, a doubling backoff."""

from __future__ import annotations

import pytest

from offpolicy.config import ConfigError, SuperviseConfig, load_config
from offpolicy.plumbing.restarts import RestartPolicy
from tests.conftest import QUICKSTART


def test_backoff_doubles_up_to_its_limit_and_the_budget_is_per_process():
    p = RestartPolicy(SuperviseConfig(max_restarts=4, backoff_s=1.0, max_backoff_s=3.0, restart_window_s=100))
    assert [p.decide("rollout-0", t).delay_s for t in (0, 1, 2, 3)] == [1.0, 2.0, 3.0, 3.0]
    refused = p.decide("rollout-0", 4)
    assert not refused.allowed and refused.count == 4
    assert "run.supervise.max_restarts=4" in refused.reason and "restart_window_s=100" in refused.reason
    assert p.decide("learner", 4).allowed  # another process has its own budget
    first = p.decide("rollout-0", 101)  # the first restart left the window: one is free again
    assert first.allowed and first.count == 4


def test_a_proven_death_restarts_at_once_and_leaves_the_backoff_alone_but_counts_against_the_budget():
    p = RestartPolicy(SuperviseConfig(max_restarts=4, backoff_s=1.0, max_backoff_s=8.0, restart_window_s=100))
    assert p.decide("learner", 0).delay_s == 1.0  # died before the run trained a step: backoff
    proven = p.decide("learner", 1, proven=True)  # it trained since: at once
    assert proven.allowed and proven.delay_s == 0.0 and proven.count == 2
    assert p.decide("learner", 2).delay_s == 2.0  # the backoff doubles over the deaths that were not proven only
    assert p.decide("learner", 3, proven=True).delay_s == 0.0
    assert not p.decide("learner", 4, proven=True).allowed  # the budget counts every restart


def test_a_budget_of_zero_refuses_the_first_and_restart_false_every_restart():
    assert not RestartPolicy(SuperviseConfig(max_restarts=0)).decide("x", 0).allowed
    off = RestartPolicy(SuperviseConfig(restart=False)).decide("x", 0)
    assert not off.allowed and off.reason == "run.supervise.restart is false"


def test_window_zero_counts_over_the_whole_run():
    p = RestartPolicy(SuperviseConfig(max_restarts=1, restart_window_s=0))
    assert p.decide("x", 0).allowed
    assert "in this run" in p.decide("x", 10**9).reason


@pytest.mark.parametrize("override, field", [("run.supervise.max_restarts=-1", "run.supervise.max_restarts"),
                                             ("run.supervise.backoff_s=-1", "run.supervise.backoff_s"),
                                             ("run.supervise.max_backoff_s=0.5", "run.supervise.max_backoff_s"),
                                             ("run.supervise.kill_grace_s=0", "run.supervise.kill_grace_s"),
                                             ("run.supervise.spare_nice=20", "run.supervise.spare_nice"),
                                             ("run.supervise.spare_nice=-1", "run.supervise.spare_nice")])
def test_bad_supervise_fields_are_refused_by_name(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(QUICKSTART, [override])
