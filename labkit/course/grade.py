"""Grading a class: run each learner's lab notebooks and report which exercise checks pass.

`grade_folder(folder)` finds every lab notebook under `folder` (`<learner>/<NN_lab>.ipynb`, or
`<NN_lab>.ipynb` directly inside it for one learner), executes each in its own kernel with papermill
(every cell, errors allowed, each cell limited to `timeout_s`), and reads back each check cell (a cell
calling `check_...(`): "pass" when it ran without error, "not done" when it hit an exercise stub (or a name
the unfinished exercise never defined), "fail: <the check's hint>" otherwise, "not run" when the kernel
never got there. `table` and `write_csv` report it per learner and lab. Used by `labkit grade DIR`.
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

__all__ = ["LabGrade", "grade_folder", "grade_notebook", "table", "write_csv"]

_CHECK = re.compile(r"\bcheck_\w+\(")
_LAB = re.compile(r"^\d\d_\w+\.ipynb$")


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


def _status(cell: nbformat.NotebookNode) -> str:
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if not errors:
        return "pass" if cell.get("execution_count") else "not run"
    e = errors[0]
    ename, evalue = e.get("ename", ""), e.get("evalue", "")
    if is_stub_error(ename, evalue, e.get("traceback", [])) or ename == "NameError":
        return "not done"
    first = next((line for line in evalue.splitlines() if line.strip()), "")
    return f"fail: {ename}: {first[:300]}"


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
    for cell in executed.cells:
        if cell.cell_type == "code" and (m := _CHECK.search(cell.source)) and "def check_" not in cell.source:
            grade.checks.append((m.group(0)[:-1], _status(cell) if ran else "not run"))
    grade.seconds = run.seconds
    return grade


def grade_folder(
    folder: str | Path, parameters: Mapping[str, Any] | None = None, timeout_s: float = 600
) -> list[LabGrade]:
    """Every lab notebook under `folder`, by learner (its folder's name) and lab, in order."""
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
    return [
        grade_notebook(p, p.parent.name if p.parent != root else root.name, parameters, timeout_s)
        for p in found
    ]


def table(grades: list[LabGrade]) -> str:
    """One line per learner and lab: checks passed, each check's status, the time it took."""
    lines = [f"{'learner':<16} {'lab':<24} {'passed':>7}  checks"]
    for g in grades:
        checks = "; ".join(f"{name}: {status}" for name, status in g.checks) or "no checks"
        extra = f"  [{g.error}]" if g.error else ""
        lines.append(
            f"{g.learner:<16} {g.lab:<24} {g.passed:>3}/{len(g.checks):<3}  {checks} ({g.seconds:.0f} "
            f"s){extra}"
        )
    return "\n".join(lines)


def write_csv(grades: list[LabGrade], path: str | Path) -> None:
    """learner, lab, check, status: one row per check (a lab without checks gets one row)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["learner", "lab", "check", "status", "seconds", "error"])
        for g in grades:
            for name, status in g.checks or [("", "no checks")]:
                w.writerow([g.learner, g.lab, name, status, f"{g.seconds:.1f}", g.error])
