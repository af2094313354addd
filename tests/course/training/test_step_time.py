"""labkit.course.training.step_time: a job's step over its ranks, the spread of its steps, and the fixed job
against the clean one (a reference measured beside it, not a bound)."""

from __future__ import annotations

from labkit.course.training import TrainingJob
from labkit.course.training.loop import JobResult
from labkit.course.training.step_time import step_ms, step_spread_ms, versus_clean


def _run(*steps_per_rank: list[float]) -> list[JobResult]:
    job = TrainingJob()
    return [
        JobResult(job, rank, list(steps), sorted(steps)[len(steps) // 2], 0.0, "")
        for rank, steps in enumerate(steps_per_rank)
    ]


def test_the_step_is_the_slowest_ranks_median_and_the_spread_is_per_step_over_ranks():
    run = _run([10.0, 12.0, 11.0], [9.0, 14.0, 10.0])  # per step, the slowest: 10, 14, 11
    assert step_ms(run) == 11.0  # medians 11 and 10
    assert step_spread_ms(run) == 4.0
    assert step_spread_ms(run, _run([20.0, 20.5])) == 4.0  # the widest of the runs
    assert step_spread_ms(_run([5.0], [4.0])) == 0.0 and step_spread_ms() == 0.0  # one step: no spread


def test_after_over_under_and_far_under_the_clean_job_are_told_apart():
    above = versus_clean(110.0, 100.0, 3.0, "emulated")
    assert "10.0 ms (10%) above the clean job's 100.0 ms" in above and "bound" not in above
    inside = versus_clean(98.0, 100.0, 3.0, "emulated")
    assert "2.0 ms under the clean job's 100.0 ms, inside the 3.0 ms" in inside
    assert "a reference measured beside it, not a bound" in inside and inside.endswith("(emulated)")
    beyond = versus_clean(90.0, 100.0, 3.0, "emulated")
    assert "more than the 3.0 ms" in beyond and "not a bound" in beyond
