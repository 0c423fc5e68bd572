"""offpolicy/plan/events.py: the clock and processor sharing, against times worked out by hand."""

from __future__ import annotations

import pytest

from offpolicy.plan.events import Clock, Shared


def finish_times(capacity: float, works: list[float], starts: list[float] | None = None, background: float = 0.0):
    clock = Clock()
    res = Shared(clock, capacity, "r", background)
    done: dict[int, float] = {}
    for i, (w, t0) in enumerate(zip(works, starts or [0.0] * len(works))):
        clock.at(t0, lambda i=i, w=w: res.start(w, lambda i=i: done.__setitem__(i, clock.now)))
    clock.run(until=lambda: len(done) == len(works))
    return [done[i] for i in range(len(works))]


def test_two_jobs_on_one_gpu_share_it():
    # both at half speed until the 1 s job ends at 2 s; the 3 s job then has 2 s left alone: ends at 4 s
    assert finish_times(1, [1.0, 3.0]) == pytest.approx([2.0, 4.0])


def test_a_late_job_slows_the_running_one_from_its_start():
    # job 0 alone for 1 s (1 s left), then both at half speed: job 1 (0.5 s) ends at 2, job 0 at 2.5
    assert finish_times(1, [2.0, 0.5], [0.0, 1.0]) == pytest.approx([2.5, 2.0])


def test_cores_and_background():
    # 5 single-threaded jobs on 2 cores: speed 0.4; 1 job with 3 background tasks on 2 cores: 0.5
    assert finish_times(2, [0.4] * 5) == pytest.approx([1.0] * 5)
    assert finish_times(2, [1.0], background=3) == pytest.approx([2.0])
    assert finish_times(2, [1.0, 1.0]) == pytest.approx([1.0, 1.0])  # two cores, two jobs: full speed


def test_a_resource_refuses_no_capacity():
    with pytest.raises(ValueError, match="capacity"):
        Shared(Clock(), 0)
