"""Grading a class: run each learner's lab notebooks and report which exercise checks pass.

`grade_folder(folder)` finds every lab notebook under `folder` (`<learner>/<NN_lab>.ipynb`, or
`<NN_lab>.ipynb` directly inside it for one learner), checks the parameters given for them as `labkit run -p`
does (`labkit.course.parameters.lab_parameters`: each lab gets the ones that are its parameters; a key no lab
takes, or a value a lab refuses, is a `ParamError` before any kernel starts), executes each in its own kernel
with papermill (every cell, errors allowed, each cell limited to `timeout_s`), and reads back each check cell
(a cell calling `check_...(`, `check_cells`): the exercises' checks and each lab's end-to-end check. A
check is "pass" when its cell ran without error, "not done" when it hit an exercise stub (or a name the
unfinished exercise never defined), "fail: <the error's first paragraph: the check's numbers and hint>"
otherwise, "not run" when the kernel never got there. `write_csv` keeps each status whole (one row per
check); `table` prints one line per learner and lab, a long status shortened at a word with "…" (the CSV has
it whole). Used by `labkit grade DIR`.
"""

from __future__ import annotations

import csv
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from labkit.course.execute import execute
from labkit.course.notebooks import is_stub_error
from labkit.course.parameters import lab_parameters

__all__ = [
    "TABLE_STATUS_CHARS",
    "LabGrade",
    "check_cells",
    "grade_folder",
    "grade_notebook",
    "table",
    "write_csv",
]

_CHECK = re.compile(r"\bcheck_\w+\(")
_LAB = re.compile(r"^\d\d_\w+\.ipynb$")
TABLE_STATUS_CHARS = 160  # a check's status in the printed table, at most (the CSV keeps it whole)


@dataclass
class LabGrade:
    learner: str
    lab: str
    checks: list[tuple[str, str]] = field(default_factory=list)  # (check name, status)
    seconds: float = 0.0
    error: str = ""  # the run's own failure (a timeout, a dead kernel), if any

    @property
    def passed(self) -> int:
        return sum(status == "pass" for _, status in self.checks)


def check_cells(nb: nbformat.NotebookNode) -> list[tuple[int, str]]:
    """The cells `grade_notebook` grades, as (index, the check's name): code cells that call `check_...(`
    (the first such call names it), not those that define one."""
    return [
        (i, m.group(0)[:-1])
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (m := _CHECK.search(cell.source)) and "def check_" not in cell.source
    ]


def _first_paragraph(text: str) -> str:
    """The lines of `text` up to its first blank line (leading blank lines skipped), joined into one."""
    lines: list[str] = []
    for line in text.strip().splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    return " ".join(lines)


def _shorten(text: str, width: int) -> str:
    """`text`, or when longer than `width` characters its words that fit, then "…" (cut mid-word only when
    its first word alone is longer)."""
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    if text[width - 1] != " " and " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:") + "…"


def _status(cell: nbformat.NotebookNode) -> str:
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if not errors:
        return "pass" if cell.get("execution_count") else "not run"
    e = errors[0]
    ename, evalue = e.get("ename", ""), e.get("evalue", "")
    if is_stub_error(ename, evalue, e.get("traceback", [])) or ename == "NameError":
        return "not done"
    return f"fail: {ename}: {_first_paragraph(evalue)}"


def grade_notebook(
    path: Path, learner: str, parameters: Mapping[str, Any] | None = None, timeout_s: float = 600
) -> LabGrade:
    """Execute one learner's notebook (all cells, errors allowed) and read back its check cells."""
    grade = LabGrade(learner, path.stem)
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        run = execute(
            path,
            Path(tmp) / path.name,
            parameters=parameters,
            cwd=tmp,
            cell_timeout=timeout_s,
            allow_errors=True,
        )
        if not run.ok and not run.source:  # a cell over the time limit, a kernel that died
            grade.error = run.error
        ran = run.ran  # the executed copy is in `tmp`, which is gone after this block
        executed = nbformat.read(run.notebook if ran else path, as_version=4)
    for i, name in check_cells(executed):
        grade.checks.append((name, _status(executed.cells[i]) if ran else "not run"))
    grade.seconds = run.seconds
    return grade


def grade_folder(
    folder: str | Path, parameters: Mapping[str, Any] | None = None, timeout_s: float = 600
) -> list[LabGrade]:
    """Every lab notebook under `folder`, by learner (its folder's name) and lab, in order; each lab gets the
    values of `parameters` that are its own, all checked before the first kernel starts (`ParamError`)."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(
            f"{root} is not a folder: give the folder of learners' notebooks "
            "(<learner>/<NN_lab>.ipynb), e.g. labkit grade submissions/"
        )
    found = sorted(
        p for p in root.rglob("*.ipynb") if _LAB.match(p.name) and ".ipynb_checkpoints" not in p.parts
    )
    if not found:
        raise ValueError(f"no lab notebooks (NN_name.ipynb) under {root}")
    per_lab = lab_parameters(sorted({p.stem for p in found}), parameters or {}, "graded")
    return [
        grade_notebook(p, p.parent.name if p.parent != root else root.name, per_lab[p.stem], timeout_s)
        for p in found
    ]


def table(grades: list[LabGrade], csv_path: str | Path | None = None) -> str:
    """One line per learner and lab: checks passed, each check's status (one longer than
    `TABLE_STATUS_CHARS` shortened at a word, with "…"; a last line then says that the CSV, `csv_path` if it
    is written, has the whole text), the time it took."""
    lines = [f"{'learner':<16} {'lab':<24} {'passed':>7}  checks"]
    shortened = False
    for g in grades:
        shown = [(name, _shorten(status, TABLE_STATUS_CHARS)) for name, status in g.checks]
        shortened = shortened or any(s != status for (_, s), (_, status) in zip(shown, g.checks))
        checks = "; ".join(f"{name}: {status}" for name, status in shown) or "no checks"
        extra = f"  [{g.error}]" if g.error else ""
        lines.append(
            f"{g.learner:<16} {g.lab:<24} {g.passed:>3}/{len(g.checks):<3}  {checks} ({g.seconds:.0f} "
            f"s){extra}"
        )
    if shortened:
        where = f"{csv_path} has" if csv_path else "the CSV (--csv FILE) has"
        lines.append(f"(… : a status shortened here at a word; {where} each one whole)")
    return "\n".join(lines)


def write_csv(grades: list[LabGrade], path: str | Path) -> None:
    """learner, lab, check, status: one row per check (a lab without checks gets one row), each status whole
    (a failed check's first paragraph: its numbers and its hint)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["learner", "lab", "check", "status", "seconds", "error"])
        for g in grades:
            for name, status in g.checks or [("", "no checks")]:
                w.writerow([g.learner, g.lab, name, status, f"{g.seconds:.1f}", g.error])
