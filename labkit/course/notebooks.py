"""Build ``labs/`` from ``solutions/``, strip notebooks, and check that labs run.

``solutions/`` is the source; ``labs/`` is generated from it:

* in code cells, the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
  become a stub: a comment saying what to write and
  ``raise NotImplementedError("Exercise: <hint> (about N lines)")``. The hint comes from a
  ``### HINT: ...`` line inside the block, else from the block's leading comment lines.
  N counts the block's non-blank lines that are not comments.
* cells tagged ``solution-only`` are dropped;
* markdown between ``<!-- BEGIN SOLUTION -->`` and ``<!-- END SOLUTION -->`` is removed
  (a markdown cell left empty is dropped).

Every notebook written here is stripped (no outputs, no execution counts, no widget
state) and serialised deterministically, so ``check`` is byte-stable.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import nbformat

from labkit.course.execute import execute
from labkit.course.experiments import registry
from labkit.course.parameters import PARAMETERS_TAG, parameters_source, with_parameters

__all__ = [
    "BEGIN_SOLUTION",
    "END_SOLUTION",
    "HINT_PREFIX",
    "SOLUTION_ONLY_TAG",
    "STUB_PREFIX",
    "build",
    "check",
    "has_outputs",
    "is_stub_error",
    "lab_text",
    "lint",
    "list_notebooks",
    "make_lab",
    "notebook_text",
    "outputs_present",
    "run_until_stub",
    "solution_text",
    "strip",
    "strip_markdown_solution",
    "strip_notebook",
    "stub_code",
]

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
HINT_PREFIX = "### HINT:"
MD_BEGIN = "<!-- BEGIN SOLUTION -->"
MD_END = "<!-- END SOLUTION -->"
SOLUTION_ONLY_TAG = "solution-only"
STUB_PREFIX = "Exercise:"
DEFAULT_HINT = "complete this cell"

# Metadata that only describes one execution; removed by strip().
_NOTEBOOK_RUN_METADATA = ("widgets", "papermill")
_CELL_RUN_METADATA = ("execution", "papermill", "ExecuteTime", "collapsed", "scrolled")


def list_notebooks(directory: str | Path) -> list[Path]:
    """Return the ``*.ipynb`` files directly in ``directory``, sorted; [] if it does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("*.ipynb") if p.is_file())


# ---------------------------------------------------------------- solution -> stub


def _stub_lines(block: list[str], indent: str) -> list[str]:
    """Turn the lines of one solution block into the stub that replaces them."""
    hint_lines = [
        line.strip()[len(HINT_PREFIX) :].strip() for line in block if line.strip().startswith(HINT_PREFIX)
    ]
    body = [line for line in block if not line.strip().startswith(HINT_PREFIX)]
    if hint_lines:
        hint = " ".join(h for h in hint_lines if h)
    else:
        comments = []
        for line in body:
            stripped = line.strip()
            if not stripped:
                continue
            if not stripped.startswith("#"):
                break
            comments.append(stripped.lstrip("#").strip())
        hint = " ".join(c for c in comments if c)
    hint = hint or DEFAULT_HINT
    n_lines = sum(1 for line in body if line.strip() and not line.strip().startswith("#"))
    n_lines = max(n_lines, 1)
    message = f"{STUB_PREFIX} {hint} (about {n_lines} line{'s' if n_lines > 1 else ''})"
    return [
        f"{indent}# EXERCISE: {hint}",
        f"{indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})",
    ]


def stub_code(source: str, where: str = "cell") -> str:
    """Replace each ``### BEGIN/END SOLUTION`` block in ``source`` with an exercise stub.

    Raises ValueError (naming ``where`` and the line) on nested, unclosed or stray markers.
    """
    out: list[str] = []
    block: list[str] | None = None
    indent = ""
    begin_line = 0
    for number, line in enumerate(source.split("\n"), start=1):
        stripped = line.strip()
        if stripped == BEGIN_SOLUTION:
            if block is not None:
                raise ValueError(
                    f"{where}, line {number}: {BEGIN_SOLUTION!r} inside the block opened on "
                    f"line {begin_line}; close it with {END_SOLUTION!r} first"
                )
            block, indent, begin_line = [], line[: len(line) - len(line.lstrip())], number
        elif stripped == END_SOLUTION:
            if block is None:
                raise ValueError(
                    f"{where}, line {number}: {END_SOLUTION!r} without a {BEGIN_SOLUTION!r} before it"
                )
            out.extend(_stub_lines(block, indent))
            block = None
        elif block is not None:
            block.append(line)
        else:
            out.append(line)
    if block is not None:
        raise ValueError(
            f"{where}, line {begin_line}: {BEGIN_SOLUTION!r} is never closed; "
            f"add a line {END_SOLUTION!r} after the solution"
        )
    return "\n".join(out)


def strip_markdown_solution(source: str, where: str = "cell") -> str:
    """Remove every ``<!-- BEGIN SOLUTION -->...<!-- END SOLUTION -->`` span from ``source``."""
    if MD_BEGIN not in source and MD_END not in source:
        return source
    out = []
    rest = source
    while True:
        begin = rest.find(MD_BEGIN)
        end = rest.find(MD_END)
        if begin == -1 and end == -1:
            out.append(rest)
            break
        if begin == -1 or (end != -1 and end < begin):
            raise ValueError(f"{where}: {MD_END!r} without a {MD_BEGIN!r} before it")
        if end == -1:
            raise ValueError(f"{where}: {MD_BEGIN!r} is never closed; add {MD_END!r}")
        inner_begin = rest.find(MD_BEGIN, begin + len(MD_BEGIN))
        if inner_begin != -1 and inner_begin < end:
            raise ValueError(f"{where}: nested {MD_BEGIN!r}; close the first block before opening another")
        out.append(rest[:begin])
        rest = rest[end + len(MD_END) :]
    text = "".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


# ---------------------------------------------------------------- stripping


def _tags(cell: Mapping[str, Any]) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def strip_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Remove outputs, execution counts and run-only metadata from ``nb`` in place; return it."""
    for key in _NOTEBOOK_RUN_METADATA:
        nb.metadata.pop(key, None)
    for cell in nb.cells:
        for key in _CELL_RUN_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def _fix_cell_ids(nb: nbformat.NotebookNode) -> None:
    """Give nbformat 4.5+ cells a missing or duplicate id derived from position and content.

    nbformat would otherwise fill them with random ids, and ``check`` would never pass.
    """
    if nb.get("nbformat_minor", 0) < 5:
        return
    seen = set()
    for index, cell in enumerate(nb.cells):
        if not cell.get("id") or cell["id"] in seen:
            digest = hashlib.sha1(f"{index}:{cell.cell_type}:{cell.source}".encode())
            cell["id"] = f"cell-{index}-{digest.hexdigest()[:8]}"
        seen.add(cell["id"])


def notebook_text(nb: nbformat.NotebookNode) -> str:
    """Serialise ``nb`` deterministically: nbformat 4 JSON, sorted keys, trailing newline.

    Missing or duplicate cell ids are filled in place (see ``_fix_cell_ids``).
    """
    _fix_cell_ids(nb)
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def _read(path: Path) -> nbformat.NotebookNode:
    """Read a notebook as nbformat 4 without nbformat's repairs (which add random cell ids)."""
    nb = nbformat.convert(nbformat.reader.reads(path.read_text(encoding="utf-8")), 4)
    _fix_cell_ids(nb)
    return nb


def _write_if_changed(path: Path, text: str) -> bool:
    data = text.encode("utf-8")
    if path.is_file() and path.read_bytes() == data:
        return False
    path.write_bytes(data)
    return True


def strip(path: str | Path) -> bool:
    """Strip the notebook at ``path`` in place; return True if the file changed."""
    path = Path(path)
    return _write_if_changed(path, notebook_text(strip_notebook(_read(path))))


def has_outputs(nb: nbformat.NotebookNode) -> bool:
    """True if ``nb`` holds outputs, execution counts or widget state."""
    if "widgets" in nb.metadata:
        return True
    return any(
        cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
        for cell in nb.cells
    )


def outputs_present(paths: Iterable[str | Path]) -> list[Path]:
    """Return the notebooks among ``paths`` that carry outputs (fix: ``strip`` them)."""
    return [Path(p) for p in paths if has_outputs(_read(Path(p)))]


# ---------------------------------------------------------------- build / check


def make_lab(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """Return the stripped lab notebook generated from a solution notebook."""
    lab = copy.deepcopy(solution)
    cells = []
    for index, cell in enumerate(lab.cells):
        where = f"{name}, cell {index}"
        if SOLUTION_ONLY_TAG in _tags(cell):
            continue
        if cell.cell_type == "code":
            cell.source = stub_code(cell.source, where)
        elif cell.cell_type == "markdown":
            cell.source = strip_markdown_solution(cell.source, where)
            if not cell.source.strip():
                continue
        cells.append(cell)
    lab.cells = cells
    return strip_notebook(lab)


def lab_text(solution_path: str | Path) -> str:
    """Return the exact file text of the lab generated from ``solution_path``."""
    solution_path = Path(solution_path)
    return notebook_text(make_lab(_read(solution_path), solution_path.name))


def solution_text(solution_path: str | Path) -> str:
    """The solution notebook's file text with its parameters cell written from its lab's `Params`
    (`labkit.course.parameters`); the file's own text for a notebook that is not a course lab."""
    path = Path(solution_path)
    if path.stem not in registry.LABS:
        return path.read_text(encoding="utf-8")
    nb = _read(path)
    with_parameters(nb, parameters_source(registry.params_of(path.stem), registry.LABS[path.stem]))
    return notebook_text(nb)


def build(solutions_dir: str | Path, labs_dir: str | Path) -> list[Path]:
    """Write each solution notebook's parameters cell from its lab's `Params`, then generate
    ``labs_dir/<name>.ipynb`` from it; return the files (re)written.

    Files already up to date are left alone. Lab notebooks without a solution are not
    deleted (``check`` reports them).
    """
    solutions = list_notebooks(solutions_dir)
    refreshed = {path: solution_text(path) for path in solutions}
    written = [path for path, text in refreshed.items() if _write_if_changed(path, text)]
    texts = {path.name: lab_text(path) for path in solutions}  # fail before writing anything
    labs_dir = Path(labs_dir)
    labs_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        target = labs_dir / name
        if _write_if_changed(target, text):
            written.append(target)
    return written


def check(solutions_dir: str | Path, labs_dir: str | Path) -> list[str]:
    """Return problems that make ``labs_dir`` differ from what ``build`` would write; [] if none."""
    labs_dir = Path(labs_dir)
    problems = []
    names = set()
    for path in list_notebooks(solutions_dir):
        names.add(path.name)
        target = labs_dir / path.name
        try:
            if path.read_bytes() != solution_text(path).encode("utf-8"):
                problems.append(
                    f"stale: {path}'s parameters cell differs from its lab's Params (run `labkit build`)"
                )
            text = lab_text(path)
        except ValueError as exc:
            problems.append(f"cannot build {path}: {exc}")
            continue
        if not target.is_file():
            problems.append(f"missing: {target} (run `labkit build`)")
        elif target.read_bytes() != text.encode("utf-8"):
            problems.append(f"stale: {target} differs from what {path} generates (run `labkit build`)")
    for path in list_notebooks(labs_dir):
        if path.name not in names:
            problems.append(
                f"extra: {path} has no source {Path(solutions_dir) / path.name} "
                "(delete it, or add the solution notebook)"
            )
    return problems


def lint(path: str | Path) -> list[str]:
    """Return problems that stop papermill running ``path`` as a lab; [] if none.

    A lab needs exactly one cell tagged ``parameters`` and the ``python3`` kernel.
    """
    nb = _read(Path(path))
    problems = []
    tagged = [i for i, cell in enumerate(nb.cells) if PARAMETERS_TAG in _tags(cell)]
    if len(tagged) != 1:
        problems.append(
            f"{path}: {len(tagged)} cells tagged {PARAMETERS_TAG!r} (cells {tagged}); "
            "tag exactly one code cell of small defaults"
        )
    elif nb.cells[tagged[0]].cell_type != "code":
        problems.append(f"{path}: cell {tagged[0]} tagged {PARAMETERS_TAG!r} is not a code cell")
    kernel = nb.metadata.get("kernelspec", {}).get("name")
    if kernel != "python3":
        problems.append(
            f"{path}: kernelspec name is {kernel!r}; set it to 'python3' so papermill "
            "runs the notebook with the interpreter that has labkit"
        )
    return problems


# ---------------------------------------------------------------- run until the first stub


def is_stub_error(ename: str, evalue: str, traceback: Iterable[str]) -> bool:
    """True if the error is an exercise stub's NotImplementedError (possibly re-raised by a worker)."""
    if ename == "NotImplementedError" and evalue.startswith(STUB_PREFIX):
        return True
    wrapped = f"NotImplementedError: {STUB_PREFIX}"
    return wrapped in evalue or any(wrapped in line for line in traceback)


def _stub_cells(nb: nbformat.NotebookNode) -> list[int]:
    marker = f'raise NotImplementedError("{STUB_PREFIX}'
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and marker in cell.source]


def _describe_cell(nb: nbformat.NotebookNode, source: str) -> str:
    """Name the input cell whose source is ``source`` (papermill's index counts injected cells)."""
    first = next((line for line in source.splitlines() if line.strip()), "")
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.source == source:
            return f"cell {index} ({first!r})"
    return f"the injected parameters cell ({first!r})"


def run_until_stub(
    path: str | Path,
    parameters: Mapping[str, Any] | None = None,
    timeout: float = 120,
    output_path: str | Path | None = None,
    cwd: str | Path | None = None,
) -> tuple[bool, str]:
    """Execute a lab with papermill (`labkit.course.execute`); pass iff its first error is an exercise stub.

    ``timeout`` is the per-cell limit in seconds. The executed copy goes to ``output_path``
    (default: a temporary file) and runs in ``cwd`` (default: the executed copy's folder).
    A notebook without any stub passes iff it runs to the end. Returns ``(ok, message)``.
    """
    path = Path(path)
    stubs = _stub_cells(_read(path))
    with tempfile.TemporaryDirectory(prefix="labkit-run-") as tmp:
        out = Path(output_path) if output_path is not None else Path(tmp) / path.name
        run = execute(path, out, parameters=parameters, cwd=cwd, cell_timeout=timeout)
    if not run.ok and not run.source:  # cell timeout, dead kernel, missing kernel
        return False, f"{path.name}: execution failed: {run.error}"
    if not run.ok:
        where = _describe_cell(_read(path), run.source)
        if is_stub_error(run.ename, run.evalue, run.traceback):
            return True, f"{path.name}: reached the exercise stub in {where}: {run.evalue}"
        return False, (
            f"{path.name}: {where} raised {run.ename}: {run.evalue} before any exercise stub; everything "
            "before the first stub must run"
        )
    if stubs:
        return False, (
            f"{path.name}: ran to the end without reaching an exercise stub (stubs in cells "
            f"{stubs}); is the stubbed function ever called, or is its error caught?"
        )
    return True, f"{path.name}: no exercise stubs; ran to the end"
