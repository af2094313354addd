"""labkit.course.experiments.imbalanced_pipeline_checks (lab 04's checks): the end-to-end check,
`check_pipeline`, passes a run that shows the lesson, names each way one can fail with its numbers and hint,
and refuses exactly what the notebook's asserts refused before it had a home (the same conditions, no weaker).
The exercise's check, `check_balance`, is run through its wrong answers by the lab's mutation tests."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from labkit.course.experiments.imbalanced_pipeline_checks import check_pipeline


def _run(step_ms=100.0, limit_ms=90.0, imbalance=1.1, grad_error=1e-7, loss_error=1e-7, sizes=(7, 6, 6, 7)):
    """The fields of a `PipelineSummary` the check reads."""
    return SimpleNamespace(
        step_ms=step_ms,
        limit_ms=limit_ms,
        imbalance=imbalance,
        grad_error=grad_error,
        loss_error=loss_error,
        sizes=list(sizes),
        micro_batches=8,
    )


def _measured(before=None, after=None, **others):
    return {
        "before": before or _run(step_ms=150.0, limit_ms=100.0, imbalance=1.6, sizes=(7, 6, 6, 7)),
        "balanced, few micro-batches": _run(step_ms=130.0, limit_ms=100.0),
        "after": after or _run(),
        "gpipe": _run(step_ms=101.0),
        **others,
    }


def test_a_run_that_shows_the_lesson_passes():
    assert check_pipeline(_measured()) == pytest.approx(100 / 90)
    assert check_pipeline(_measured(), emulated=False) == pytest.approx(100 / 90)


@pytest.mark.parametrize(
    "after,before,message",
    [
        (_run(step_ms=125.0, limit_ms=90.0), None, "after is 1.39 x the ideal pipeline (125.0 ms against"),
        (_run(step_ms=100.0, limit_ms=90.0), _run(step_ms=99.0), "after 100 ms, before 99 ms, limit 90 ms"),
        (
            _run(step_ms=85.0, limit_ms=90.0),
            None,
            "cannot beat the limit; hint: is the split from my_balance",
        ),
        (_run(imbalance=1.35), None, "the busiest rank works 1.35 x the mean"),
    ],
)
def test_each_timing_failure_is_named_with_its_numbers(after, before, message):
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(_measured(before=before, after=after))
    # on GPUs the notebook gives the verdict instead: only the gradients are the check's
    check_pipeline(_measured(before=before, after=after), emulated=False)


def test_wrong_gradients_fail_everywhere_naming_the_plan():
    for emulated in (True, False):
        with pytest.raises(AssertionError, match=r"the 'gpipe' run's gradients .* differ .* by 2.0e-03"):
            check_pipeline(_measured(gpipe=_run(grad_error=2e-3)), emulated=emulated)
        with pytest.raises(AssertionError, match="gradients"):
            check_pipeline(_measured(gpipe=_run(grad_error=math.nan)), emulated=emulated)
        with pytest.raises(AssertionError, match="the after run's loss differs"):
            check_pipeline(_measured(after=_run(loss_error=1e-3)), emulated=emulated)
    with pytest.raises(ValueError, match="run it with check=True"):
        check_pipeline(_measured(gpipe=_run(grad_error=None)))


def _the_notebooks_asserts(measured, emulated):
    """The check cell of solutions/04_imbalanced_pipeline.ipynb before `check_pipeline` (its asserts)."""
    before, after = measured["before"], measured["after"]
    worst = max(s.grad_error for s in measured.values())
    assert worst < 1e-5 and after.loss_error < 1e-5
    to_limit = after.step_ms / after.limit_ms
    if emulated:
        assert to_limit <= 1.3
        assert after.limit_ms <= after.step_ms < before.step_ms
        assert after.imbalance <= 1.3


def test_it_refuses_what_the_notebooks_asserts_refused():
    grid = itertools.product(
        [80.0, 90.0, 100.0, 117.0, 118.0, 130.0],  # after's step (limit 90: 1.3 x is 117)
        [95.0, 117.0, 140.0],  # before's step
        [1.0, 1.3, 1.31],  # after's imbalance
        [1e-7, 9.9e-6, 1e-5],  # gpipe's gradient error
        [True, False],
    )
    for after_ms, before_ms, imbalance, grad, emulated in grid:
        measured = _measured(
            before=_run(step_ms=before_ms),
            after=_run(step_ms=after_ms, imbalance=imbalance),
            gpipe=_run(grad_error=grad),
        )
        try:
            _the_notebooks_asserts(measured, emulated)
            refused_before = False
        except AssertionError:
            refused_before = True
        try:
            check_pipeline(measured, emulated=emulated)
            refused_now = False
        except AssertionError:
            refused_now = True
        assert refused_now == refused_before, (after_ms, before_ms, imbalance, grad, emulated)
