"""The usual slips behind a wrong number, by their signature: a check lists what each slip would have given
(the right answer scaled by 1,000 for a unit, by the world size or tp for a sum over ranks, the formula
redone with 2 bytes per element instead of 4, ...) and `name_slip` says which one the learner's number is."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["name_slip", "name_slip_across", "scaled", "unit_slips"]


def scaled(want: float, factors: Iterable[tuple[float, str]]) -> list[tuple[float, str]]:
    """(want x factor, hint) for each (factor, hint)."""
    return [(want * factor, hint) for factor, hint in factors]


def unit_slips(want: float, unit: str) -> list[tuple[float, str]]:
    """A number in the wrong unit of time: seconds or microseconds where `unit` is "ms", ms or µs where it is
    "s"."""
    if unit == "ms":
        return scaled(
            want,
            (
                (1e-3, "exactly 1,000 times too small: that is seconds; multiply by 1,000 for ms"),
                (1e3, "exactly 1,000 times too large: that is microseconds; divide by 1,000 for ms"),
            ),
        )
    if unit == "s":
        return scaled(
            want,
            (
                (1e3, "exactly 1,000 times too large: that is milliseconds; divide by 1,000 for seconds"),
                (1e6, "a million times too large: that is microseconds; divide by 1e6 for seconds"),
            ),
        )
    raise ValueError(f"unit={unit!r}: unit_slips knows 'ms' and 's'")


def name_slip(got: float, slips: Iterable[tuple[float, str]], rel_tol: float = 0.01) -> str | None:
    """The hint of the first slip whose number `got` is (within `rel_tol`), else None."""
    for value, hint in slips:
        if value and math.isclose(got, value, rel_tol=rel_tol):
            return hint
    return None


def name_slip_across(
    gots: list[float], slips: list[list[tuple[float, str]]], rel_tol: float = 0.01
) -> str | None:
    """The hint of the slip that gives every one of `gots` (`slips[i]` lists case i's, in the same order for
    every case), so that two slips that coincide on one case are told apart by another; else that of the
    first slip the first wrong case matches; else None."""
    for k, (_, hint) in enumerate(slips[0]):
        if all(
            value and math.isclose(got, value, rel_tol=rel_tol)
            for got, (value, _) in zip(gots, (case[k] for case in slips), strict=True)
        ):
            return hint
    return name_slip(gots[0], slips[0], rel_tol)
