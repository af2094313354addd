"""labkit.course.experiments.oom_batch_checks (lab 02's checks): the end-to-end check, `check_memory_fix`,
passes a fix that fits as estimated and names each way one can fail, with its numbers and hint. The exercise's
check, `check_accumulation`, is run through its wrong answers by the lab's mutation tests."""

from __future__ import annotations

import pytest

from labkit.course.experiments.oom_batch_checks import check_memory_fix


def test_a_fix_that_fits_as_estimated_passes():
    assert check_memory_fix(40.0, 20.0, 24, 1.05) == 20.0
    assert check_memory_fix(40.0, 24.0, 24, 0.91) == 24.0  # at the limit, and the estimate 9 % under


@pytest.mark.parametrize(
    "args,message",
    [
        (
            (40.0, 25.0, 24, 1.0),
            "after 25.0 MiB should fit in 24 MiB (before: 40.0 MiB); hint: check the micro",
        ),
        ((20.0, 10.0, 24, 1.0), "peaked at 20.0 MiB, within the 24 MiB per rank: there was no OOM to fix"),
        ((24.0, 10.0, 24, 1.0), "there was no OOM to fix"),
        (
            (40.0, 20.0, 24, 0.85),
            "the estimate is 0.850 x the measured peak, more than 10% off: the step held more",
        ),
        ((40.0, 20.0, 24, 1.10), "the step held less than the estimate counts"),
        ((40.0, 20.0, 24, float("nan")), "the estimate is nan x the measured peak"),
    ],
)
def test_each_failure_is_named_with_its_numbers(args, message):
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_memory_fix(*args)


def test_it_refuses_what_the_notebooks_asserts_refused():
    # solutions/02_oom_batch.ipynb, section 6, before the check had a home
    for before in (20.0, 24.0, 30.0):
        for after in (10.0, 24.0, 24.5):
            for ratio in (0.89, 0.9, 0.95, 1.0999, 1.1, 1.2):
                refused_before = not (after <= 24 < before and abs(ratio - 1) < 0.10)
                try:
                    check_memory_fix(before, after, 24, ratio)
                    refused_now = False
                except AssertionError:
                    refused_now = True
                assert refused_now == refused_before, (before, after, ratio)
