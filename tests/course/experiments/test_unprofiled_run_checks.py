"""labkit.course.experiments.unprofiled_run_checks (lab 05's checks): the end-to-end check,
`check_mystery_fix`, passes a diagnosis of the planted mistake whose fix sped the job up, and names each way
one can fail, with its numbers and hint and without naming the planted mistake. The exercise's check,
`check_find_straggler`, is run through its wrong answers by the lab's mutation tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from labkit.course.experiments.unprofiled_run_checks import check_mystery_fix
from labkit.course.training import MISTAKES

PLANTED = "per_tensor_allreduce"
FOUND = SimpleNamespace(kind=MISTAKES[PLANTED].diagnosed_as, evidence="29 collectives per step, 90 % alone")


def test_the_planted_mistake_found_and_fixed_passes():
    assert check_mystery_fix(FOUND, PLANTED, 120.0, 70.0, 65.0) == pytest.approx(50.0)
    assert check_mystery_fix(FOUND, PLANTED, 120.0, 70.0, 87.5) == pytest.approx(50.0)  # clean 1.25 x: still


def test_each_failure_is_named_with_its_numbers():
    wrong = SimpleNamespace(
        kind=MISTAKES["data_loading"].diagnosed_as, evidence="rank 0 waits 40 % of its step"
    )
    with pytest.raises(AssertionError) as info:
        check_mystery_fix(wrong, PLANTED, 120.0, 70.0, 65.0)
    text = str(info.value)
    assert f"the diagnosis ({wrong.kind}) is not the planted mistake" in text and "rank 0 waits 40 %" in text
    assert PLANTED not in text and FOUND.kind not in text  # the trace is to tell it, not the check
    with pytest.raises(
        AssertionError, match=r"did not speed the job up: before 120\.0 ms, after 120\.0 ms; hint"
    ):
        check_mystery_fix(FOUND, PLANTED, 120.0, 120.0, 65.0)
    with pytest.raises(
        AssertionError, match=r"beat the clean one \(88.0 ms\) by far: the clean one took x1.26"
    ):
        check_mystery_fix(FOUND, PLANTED, 120.0, 70.0, 88.0)
    with pytest.raises(ValueError, match=r"must be one of labkit\.course\.training\.MISTAKES"):
        check_mystery_fix(FOUND, "slow_disk", 120.0, 70.0, 65.0)
