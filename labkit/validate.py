"""Argument checks whose errors give the value, the constraint and the fix.

    positive_int("world_size", 0, "launch(fn, world_size=2)")
    ValueError: world_size=0 must be a positive whole number (>= 1); e.g. launch(fn, world_size=2)

Every public function of labkit checks its input with these before it starts any work
(torchtitan's style: say what was given, what is allowed, and what to write instead).

A lab's parameters (`labkit.course.experiments.params`) fail with `ParamError`, a ValueError that also knows
where the value was typed, so that its fix reads as the user would type it:

    n_layers=0 must be a whole number with >= 1; set it with --set n_layers 6
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["ParamError", "non_negative_int", "one_of", "positive_int", "positive_number"]

# How to write `name = value` where it was typed (ParamError.form)
_FIXES = {
    "set": "set it with --set {name} {json}",
    "p": "set it with -p {name} {json}",
    "cell": "write {name} = {py} in the parameters cell (or -p {name} {json} with labkit run / papermill)",
    "python": "pass {name}={py}",
}


class ParamError(ValueError):
    """A parameter a lab cannot run with: its name and value, the constraint, and a value that works.

    `form` says where it was typed ("set": a script's --set, "p": labkit run / papermill -p, "cell": the
    notebook's parameters cell, "python": a call); the message writes the fix that way.
    """

    def __init__(
        self,
        name: str,
        value: Any,
        constraint: str,
        example: Any = None,
        *,
        form: str = "python",
        why: str = "",
    ) -> None:
        self.name, self.value, self.constraint, self.example, self.form, self.why = (
            name,
            value,
            constraint,
            example,
            form,
            why,
        )
        super().__init__(self._message())

    def _message(self) -> str:
        why = f" ({self.why})" if self.why else ""
        if self.example is None:
            return f"{self.name}={self.value!r} must be {self.constraint}{why}"
        if isinstance(self.example, str) and self.example.isidentifier():
            json_text = self.example  # a bare word is a string on the command line
        else:
            json_text = json.dumps(self.example) if _jsonable(self.example) else repr(self.example)
        fix = _FIXES[self.form].format(name=self.name, json=_shell(json_text), py=repr(self.example))
        return f"{self.name}={self.value!r} must be {self.constraint}{why}; {fix}"

    def in_form(self, form: str) -> ParamError:
        """The same error, its fix written for `form`."""
        return ParamError(self.name, self.value, self.constraint, self.example, form=form, why=self.why)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _shell(text: str) -> str:
    """A JSON value as one shell word: quoted when it has spaces or quotes."""
    return text if text.replace(".", "").replace("-", "").isalnum() else "'" + text + "'"


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
