"""Argument checks whose errors give the value, the constraint and the fix.

    positive_int("world_size", 0, "launch(fn, world_size=2)")
    ValueError: world_size=0 must be a positive whole number (>= 1); e.g. launch(fn, world_size=2)

Every public function of labkit checks its input with these before it starts any work
(torchtitan's style: say what was given, what is allowed, and what to write instead).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["non_negative_int", "one_of", "positive_int", "positive_number"]


def _fail(name: str, value: Any, constraint: str, example: str) -> ValueError:
    fix = f"; e.g. {example}" if example else ""
    return ValueError(f"{name}={value!r} must be {constraint}{fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, example: str = "") -> int:
    """`value` if it is a whole number >= 1 (not a bool), else ValueError."""
    if not _is_int(value) or value < 1:
        raise _fail(name, value, "a positive whole number (>= 1)", example)
    return value


def non_negative_int(name: str, value: Any, example: str = "") -> int:
    """`value` if it is a whole number >= 0 (not a bool), else ValueError."""
    if not _is_int(value) or value < 0:
        raise _fail(name, value, "a whole number >= 0 (not negative)", example)
    return value


def positive_number(name: str, value: Any, example: str = "") -> float:
    """`value` if it is a number > 0 (int or float, not a bool), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _fail(name, value, "a number > 0", example)
    return value


def one_of(name: str, value: Any, choices: Iterable[Any], example: str = "") -> Any:
    """`value` if it is one of `choices`, else ValueError listing them."""
    options = list(choices)
    if value not in options:
        raise _fail(name, value, "one of " + ", ".join(repr(c) for c in options), example)
    return value
