"""Exercise checks refuse labkit's own answer, however it is reached, and name the usual slips of a number."""

from __future__ import annotations

import sys

import pytest

from labkit.course.experiments.own_answer import Reference, names_used, refusing
from labkit.course.experiments.slips import name_slip, name_slip_across, unit_slips
from labkit.pipeline_plan import balance

BALANCE = Reference(balance, "labkit.pipeline_plan.balance", "write it yourself")


def _learner(source: str):
    """A function defined as in a notebook cell: its own globals, nothing imported beforehand."""
    namespace: dict = {}
    exec(source, namespace)
    return namespace["mine"]


def test_a_function_that_names_the_reference_is_refused_before_it_runs():
    mine = _learner("from labkit.pipeline_plan import balance\ndef mine(c, s):\n    return balance(c, s)\n")
    with pytest.raises(AssertionError, match=r"mine\(\) uses labkit.pipeline_plan.balance"):
        with refusing(mine, [BALANCE]):
            raise RuntimeError("not reached: the refusal comes first")


@pytest.mark.parametrize(
    "source",
    [
        "def mine(c, s):\n    from labkit.pipeline_plan import balance\n    return balance(c, s)\n",
        "def mine(c, s):\n    import labkit.pipeline_plan as pp\n    return pp.balance(c, s)\n",
        "def helper(c, s):\n    import labkit.pipeline_plan as pp\n    return pp.balance(c, s)\n"
        "def mine(c, s):\n    return helper(c, s)\n",
    ],
    ids=["imported inside", "module attribute", "through a helper"],
)
def test_a_call_of_the_reference_while_the_function_runs_is_refused(source):
    mine = _learner(source)
    with pytest.raises(AssertionError, match=r"mine\(\) calls labkit.pipeline_plan.balance"):
        with refusing(mine, [BALANCE]):
            mine([1.0, 2.0, 3.0], 2)


def test_the_refusal_replaces_the_functions_own_error_and_the_profiler_is_restored():
    mine = _learner(
        "def mine(c, s):\n    import labkit.pipeline_plan as pp\n    pp.balance(c, s)\n    1 / 0\n"
    )
    marks = []

    def outer(frame, event, arg):  # a profiler already installed (a coverage tool, say) keeps its calls
        marks.append(event)

    sys.setprofile(outer)
    try:
        with pytest.raises(AssertionError, match=r"calls labkit\.pipeline_plan\.balance"):
            with refusing(mine, [BALANCE]):
                mine([1.0, 2.0], 1)
        assert sys.getprofile() is outer
    finally:
        sys.setprofile(None)
    assert "call" in marks


def test_a_function_of_its_own_passes_and_its_names_are_read_in_nested_code():
    mine = _learner(
        "import math\ndef mine(c, s):\n    return [len(c) for _ in range(s) if math.isfinite(s)]\n"
    )
    with refusing(mine, [BALANCE]):
        assert mine([1.0], 1) == [1]
    assert {"math", "isfinite", "len", "range"} <= names_used(mine)


def test_slips_are_named_by_their_signature():
    assert "seconds" in name_slip(0.004, unit_slips(4.0, "ms"))
    assert "microseconds" in name_slip(4000.0, unit_slips(4.0, "ms"))
    assert name_slip(4.1, unit_slips(4.0, "ms")) is None
    # two slips that coincide on the first case are told apart by the second
    per_case = [[(1.0, "a"), (1.0, "b")], [(2.0, "a"), (3.0, "b")]]
    assert name_slip_across([1.0, 3.0], per_case) == "b"
    assert name_slip_across([1.0, 9.0], per_case) == "a"  # none fits both: the first that fits the first case
    with pytest.raises(ValueError, match="unit='h'"):
        unit_slips(1.0, "h")
