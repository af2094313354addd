"""An exercise check refuses labkit's own answer: the learner's function may not call (or name) the function
the check compares it with.

A check that compares the learner's `my_balance` with `labkit.pipeline_plan.balance` passes a `my_balance`
that returns `balance(costs, stages)`, and teaches nothing. `refusing(fn, references)` wraps the check's calls
of `fn`: it looks for a reference among the names `fn` uses (its globals and closure, nested functions too),
and while `fn` runs it watches every Python call (`sys.setprofile`) for a reference's code, however it was
reached (an import inside the function, a module attribute, a helper). Either raises AssertionError saying
which reference and what to write instead. Lab 03 guards the same way by construction
(`OverlappedDDPExercise` raises for the methods the exercise asks for)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Reference", "names_used", "refusing"]


@dataclass(frozen=True)
class Reference:
    """A function the exercise asks the learner to write: `fn` itself, its dotted name, what to do instead."""

    fn: Callable[..., Any]
    name: str
    instead: str

    def refusal(self, learner: str, how: str) -> AssertionError:
        return AssertionError(
            f"{learner} {how} {self.name}, labkit's own answer: the exercise is to write it, and a check "
            f"of labkit against itself proves nothing. Instead, {self.instead}"
        )


def _code(fn: Any) -> types.CodeType | None:
    fn = getattr(fn, "__func__", fn)  # a bound method's function
    return getattr(fn, "__code__", None)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def names_used(fn: Callable[..., Any]) -> set[str]:
    """Every global, attribute and closure name `fn` uses, nested functions and comprehensions included."""
    code = _code(fn)
    return set() if code is None else _code_names(code)


def _named(fn: Callable[..., Any], references: Sequence[Reference]) -> Reference | None:
    """The reference `fn` names through its globals or its closure, if any."""
    code = _code(fn)
    if code is None:
        return None
    seen: dict[str, Any] = dict(getattr(fn, "__globals__", {}))
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
        try:
            seen[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    targets = {id(getattr(r.fn, "__func__", r.fn)): r for r in references}
    for name in names_used(fn):
        value = getattr(seen.get(name), "__func__", seen.get(name))
        if id(value) in targets:
            return targets[id(value)]
    return None


@contextmanager
def refusing(fn: Callable[..., Any], references: Sequence[Reference]) -> Iterator[None]:
    """Run the body (the check's calls of `fn`) refusing `references`: AssertionError if `fn` names one, or
    if one runs while the body does (then in place of whatever the body raised)."""
    learner = f"{getattr(fn, '__name__', 'your function')}()"
    named = _named(fn, references)
    if named is not None:
        raise named.refusal(learner, "uses")
    codes = {c: r for r in references if (c := _code(r.fn)) is not None}
    called: list[Reference] = []
    previous = sys.getprofile()

    def watch(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)
        if called:
            raise called[0].refusal(learner, "calls") from None
