"""Each notebook's parameters cell, written from its lab's `Params` (`labkit.course.experiments.params`).

`parameters_source(Params)` is the cell's code: one `name = default  # doc` line per field, the values as
literals papermill can override. `labkit build` writes it into the solution notebook (and so the lab), and
`labkit build --check` reports a cell that differs, so the defaults and their docs live in one place. The
notebook's next cell reads the values back with `Params.from_cell(globals())`, which checks them.

`lab_parameters(labs, given)` is what `labkit run -p` and `labkit grade -p` do with the values typed: per
lab, the ones that are its parameters (papermill then warns of no unknown parameter), checked by its `Params`
before any kernel starts; a key that is a parameter of none of the labs, or a value a lab refuses, is a
`ParamError` that names the lab(s) and says the fix as `-p KEY VALUE`.
"""

from __future__ import annotations

import difflib
import json
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

import nbformat

from labkit.course.experiments import registry
from labkit.course.experiments.params import RANK_WORDS, LabParams, ParamError

__all__ = ["PARAMETERS_TAG", "LabParamError", "lab_parameters", "parameters_source", "with_parameters"]

PARAMETERS_TAG = "parameters"


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def parameters_source(params: type[LabParams], module: str) -> str:
    """The parameters cell of the lab whose `Params` is `params` (defined in `module`)."""
    docs, defaults = params.field_docs(), params.defaults()
    lines = [f"{name} = {_literal(defaults[name])}" for name in docs]
    width = max(len(line) for line in lines) + 2
    head = [
        "# Parameters: papermill (labkit run -p KEY VALUE) overrides them; the defaults run on a 2-core CPU.",
        f"# Written by labkit build from {module}.Params, which checks them in the next cell.",
    ]
    return "\n".join(head + [f"{line:<{width}}# {doc}" for line, doc in zip(lines, docs.values())])


def with_parameters(nb: nbformat.NotebookNode, source: str) -> bool:
    """Put `source` into `nb`'s parameters cell; True if it changed (ValueError without exactly one)."""
    tagged = [
        c
        for c in nb.cells
        if c.cell_type == "code" and PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])
    ]
    if len(tagged) != 1:
        raise ValueError(f"{len(tagged)} code cells tagged {PARAMETERS_TAG!r}: a lab has exactly one")
    changed = tagged[0].source != source
    tagged[0].source = source
    return changed


class LabParamError(ParamError):
    """A `ParamError` raised by one lab's `Params` (`lab`), its message prefixed with the lab's name."""

    def __init__(self, lab: str, err: ParamError) -> None:
        self.lab = lab
        super().__init__(err.name, err.value, err.constraint, err.example, form=err.form, why=err.why)

    def _message(self) -> str:
        return f"lab {self.lab}: {super()._message()}"


def _typed(key: str, value: Any) -> str:
    """`-p KEY VALUE` as the user would type it (the value as JSON, a bare word as it is)."""
    text = value if isinstance(value, str) and value.isidentifier() else json.dumps(value)
    return f"-p {key} {shlex.quote(text)}"


def _suggested(name: str, value: Any, fields: Mapping[str, Mapping[str, Any]]) -> str:
    """`-p name value` where the lab having `name` takes `value`, else `-p name <its default>`, saying why:
    a suggestion must not repeat a value that fails next."""
    lab = next(lab for lab, f in fields.items() if name in f)
    try:
        registry.params_of(lab).make({name: value}, "p")
    except ParamError as err:
        return f"{_typed(name, fields[lab][name])} ({name}={value!r} would fail: {err.constraint})"
    return _typed(name, value)


def _unknown(key: str, value: Any, fields: Mapping[str, Mapping[str, Any]], verb: str) -> ParamError:
    """The error for `-p key value` when `key` is a parameter of none of the labs in `fields` (lab -> its
    parameters and their defaults): the labs and their parameters, and the fix."""
    labs = list(fields)
    common = [k for k in fields[labs[0]] if all(k in f for f in fields.values())] if labs else []
    own = {lab: [k for k in f if k not in common] for lab, f in fields.items()}
    if len(labs) == 1:
        where = f"{labs[0]}, the lab {verb} ({', '.join(fields[labs[0]])})"
    else:
        listed = "; ".join(f"{lab}: {', '.join(keys) or 'no others'}" for lab, keys in own.items())
        where = f"any of the labs {verb} (every lab: {', '.join(common)}; {listed})"
    known = [k for f in fields.values() for k in f]
    close = difflib.get_close_matches(key, dict.fromkeys(known), n=1)
    # A word for the ranks that is not these labs' field for them (lab 04's are its stages): that field,
    # not whichever name happens to be spelled alike
    ranks = dict.fromkeys(r for lab in labs if (r := registry.params_of(lab).RANKS) and r != key)
    if key in RANK_WORDS and ranks:
        fix = f"the ranks are set by {' or '.join(_typed(r, value) for r in ranks)}"
    elif close:
        fix = f"did you mean {_suggested(close[0], value, fields)}? (or leave -p {key} out)"
    else:
        example = next(
            ((k, d) for lab in labs for k, d in fields[lab].items() if k in own[lab] and d is not None),
            next(((k, d) for f in fields.values() for k, d in f.items()), ("cluster", "cpu")),
        )
        fix = f"leave -p {key} out, or set one of these parameters, e.g. {_typed(*example)}"
    return ParamError(key, value, f"a parameter of {where}; {fix}", form="p")


def lab_parameters(
    labs: Iterable[str], given: Mapping[str, Any], verb: str = "run"
) -> dict[str, dict[str, Any]]:
    """Per lab (a notebook's name, e.g. "04_imbalanced_pipeline"), the values of `given` that are its
    parameters, checked by its `Params` before any kernel starts (`LabParamError` names the lab and says the
    fix as `-p KEY VALUE`). A key that is a parameter of none of the labs is refused (`ParamError` naming the
    labs, their parameters and the fix; `verb`: what is done to them, "run" or "graded"). A name that is not
    one of the course's labs gets every value, unchecked (its parameters are not known: nothing is refused
    then)."""
    names = list(dict.fromkeys(labs))
    known = [lab for lab in names if lab in registry.LABS]
    fields = {lab: registry.params_of(lab).defaults() for lab in known}
    if len(known) == len(names):
        unknown = [k for k in given if not any(k in f for f in fields.values())]
        if unknown:
            raise _unknown(unknown[0], given[unknown[0]], fields, verb)
    out: dict[str, dict[str, Any]] = {}
    for lab in names:
        if lab not in fields:
            out[lab] = dict(given)
            continue
        mine = {k: v for k, v in given.items() if k in fields[lab]}
        try:
            registry.params_of(lab).for_notebook(mine, "p")
        except ParamError as err:
            raise LabParamError(lab, err) from None
        out[lab] = mine
    return out
