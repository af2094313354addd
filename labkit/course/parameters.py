"""Each notebook's parameters cell, written from its lab's `Params` (`labkit.experiments.params`).

`parameters_source(Params)` is the cell's code: one `name = default  # doc` line per field, the values as
literals papermill can override. `labkit build` writes it into the solution notebook (and so the lab), and
`labkit build --check` reports a cell that differs, so the defaults and their docs live in one place. The
notebook's next cell reads the values back with `Params.from_cell(globals())`, which checks them.
"""

from __future__ import annotations

import json
from typing import Any

import nbformat

from labkit.experiments.params import LabParams

__all__ = ["PARAMETERS_TAG", "parameters_source", "with_parameters"]

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
