"""labkit.course.notebooks: labs/ generation from solutions/, stripping, checking, and running a lab until
its stub."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.course.notebooks import (
    build,
    check,
    has_outputs,
    is_stub_error,
    lint,
    list_notebooks,
    make_lab,
    notebook_text,
    outputs_present,
    run_until_stub,
    strip,
    strip_markdown_solution,
    stub_code,
)

EXERCISE = '''\
def bucket_sizes(sizes, cap):
    """Group gradient sizes into buckets of at most cap bytes."""
    ### BEGIN SOLUTION
    # Fill a bucket until the next gradient would overflow it.
    buckets, current = [], []

    for size in sizes:
        if current and sum(current) + size > cap:
            buckets.append(current)
            current = []
        current.append(size)
    return buckets + [current]
    ### END SOLUTION
'''


def _solution_notebook(extra_cells: list[nbformat.NotebookNode] | None = None) -> nbformat.NotebookNode:
    v4 = nbformat.v4
    nb = v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = v4.new_code_cell("n = 3")
    params.metadata["tags"] = ["parameters"]
    secret = v4.new_code_cell("assert bucket_sizes([1, 2, 3], 3) == [[1, 2], [3]]")
    secret.metadata["tags"] = ["solution-only"]
    nb.cells = [
        v4.new_markdown_cell("# Lab\nWhat you will learn."),
        params,
        v4.new_code_cell("sizes = [1] * (6 // n)"),
        v4.new_code_cell(EXERCISE),
        secret,
        v4.new_markdown_cell("Question?\n<!-- BEGIN SOLUTION -->\nAnswer: yes.\n<!-- END SOLUTION -->"),
        v4.new_markdown_cell("<!-- BEGIN SOLUTION -->\nOnly for instructors.\n<!-- END SOLUTION -->"),
        v4.new_code_cell("print(bucket_sizes(sizes, 2))"),
        *(extra_cells or []),
    ]
    return nb


def _write(nb: nbformat.NotebookNode, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(notebook_text(nb), encoding="utf-8")
    return path


# ------------------------------------------------------------------ stubs


def test_stub_keeps_indentation_uses_comment_hint_and_counts_code_lines() -> None:
    lab = stub_code(EXERCISE)
    assert lab.splitlines()[2:] == [
        "    # EXERCISE: Fill a bucket until the next gradient would overflow it.",
        (
            '    raise NotImplementedError("Exercise: Fill a bucket until the next gradient would '
            'overflow it. (about 7 lines)")'
        ),
    ]
    ast.parse(lab)
    namespace: dict = {}
    exec(lab, namespace)
    with pytest.raises(NotImplementedError, match="about 7 lines"):
        namespace["bucket_sizes"]([1], 1)


def test_hint_line_wins_and_is_not_counted() -> None:
    source = 'x = 1\n### BEGIN SOLUTION\n### HINT: say "hi" twice\n# a comment\nprint("hi")\nprint("hi")\n### END SOLUTION\ny = 2'
    assert stub_code(source) == (
        'x = 1\n# EXERCISE: say "hi" twice\nraise NotImplementedError("Exercise: say \\"hi\\" twice (about 2 '
        'lines)")\ny = 2'
    )
    ast.parse(stub_code(source))


def test_block_without_hint_gets_a_default() -> None:
    assert "Exercise: complete this cell (about 1 line)" in stub_code(
        "### BEGIN SOLUTION\nx = 1\n### END SOLUTION"
    )


@pytest.mark.parametrize(
    "source, message",
    [
        ("### BEGIN SOLUTION\nx = 1", "never closed"),
        ("x = 1\n### END SOLUTION", "without a"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside the block opened on line 1"),
    ],
)
def test_bad_code_markers_are_reported_with_line(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stub_code(source, "lab.ipynb, cell 3")


def test_markdown_solution_is_removed() -> None:
    assert (
        strip_markdown_solution("Q?\n<!-- BEGIN SOLUTION -->\nA.\n<!-- END SOLUTION -->\nMore.")
        == "Q?\n\nMore."
    )
    assert strip_markdown_solution("no markers\n\n\n") == "no markers\n\n\n"
    with pytest.raises(ValueError, match="never closed"):
        strip_markdown_solution("<!-- BEGIN SOLUTION -->")


def test_make_lab_drops_solution_only_cells_and_empty_markdown() -> None:
    solution = _solution_notebook()
    solution.cells[2].outputs = [nbformat.v4.new_output("stream", text="x")]
    solution.cells[2].execution_count = 4
    solution.metadata["widgets"] = {"state": {}}
    lab = make_lab(solution)
    sources = [cell.source for cell in lab.cells]
    assert len(lab.cells) == len(solution.cells) - 2
    assert not any("assert bucket_sizes" in s for s in sources)
    assert "Question?" in sources[4] and "Answer" not in sources[4]
    assert not has_outputs(lab)
    assert "### BEGIN SOLUTION" in solution.cells[3].source  # the source is untouched
    for cell in lab.cells:
        if cell.cell_type == "code":
            ast.parse(cell.source)


# ------------------------------------------------------------------ build / check / strip


def test_build_and_check(tmp_path: Path) -> None:
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    _write(_solution_notebook(), solutions / "01_demo.ipynb")

    assert check(solutions, labs) == [f"missing: {labs / '01_demo.ipynb'} (run `labkit build`)"]
    assert build(solutions, labs) == [labs / "01_demo.ipynb"]
    first = (labs / "01_demo.ipynb").read_bytes()
    assert first.endswith(b"\n")
    assert check(solutions, labs) == []
    assert build(solutions, labs) == []  # up to date: nothing rewritten
    assert (labs / "01_demo.ipynb").read_bytes() == first

    (labs / "01_demo.ipynb").write_bytes(first.replace(b"n = 3", b"n = 4"))
    assert check(solutions, labs)[0].startswith("stale: ")
    _write(_solution_notebook(), labs / "99_orphan.ipynb")
    problems = check(solutions, labs)
    assert any(p.startswith("extra: ") and "99_orphan" in p for p in problems)
    build(solutions, labs)
    assert (labs / "01_demo.ipynb").read_bytes() == first
    assert list_notebooks(labs) == [labs / "01_demo.ipynb", labs / "99_orphan.ipynb"]


def test_build_fails_before_writing_on_bad_markers(tmp_path: Path) -> None:
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    bad = _solution_notebook([nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1")])
    _write(bad, solutions / "02_bad.ipynb")
    with pytest.raises(ValueError, match=r"02_bad.ipynb, cell 8, line 1"):
        build(solutions, labs)
    assert list_notebooks(labs) == []
    assert check(solutions, labs)[0].startswith("cannot build ")


def test_missing_and_duplicate_cell_ids_get_stable_ids(tmp_path: Path) -> None:
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    cell = {"cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": [], "execution_count": None}
    raw = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [cell, dict(cell, id="dup"), dict(cell, id="dup")],
    }
    (solutions / "03_ids.ipynb").write_text(json.dumps(raw), encoding="utf-8")
    build(solutions, labs)
    assert check(solutions, labs) == []
    ids = [c["id"] for c in json.loads((labs / "03_ids.ipynb").read_text(encoding="utf-8"))["cells"]]
    assert ids[1] == "dup" and len(set(ids)) == 3
    assert strip(solutions / "03_ids.ipynb") is True and strip(solutions / "03_ids.ipynb") is False
    assert check(solutions, labs) == []


def test_empty_or_missing_dirs_are_fine(tmp_path: Path) -> None:
    assert check(tmp_path / "nope", tmp_path / "labs") == []
    assert build(tmp_path / "nope", tmp_path / "labs") == []


def test_strip_and_outputs_present(tmp_path: Path) -> None:
    nb = _solution_notebook()
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="x")]
    nb.cells[2].execution_count = 1
    nb.cells[2].metadata["execution"] = {"iopub.execute_input": "2025-01-01"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {}}
    dirty = _write(nb, tmp_path / "dirty.ipynb")
    clean = _write(_solution_notebook(), tmp_path / "clean.ipynb")

    assert outputs_present([dirty, clean]) == [dirty]
    assert strip(dirty) is True
    assert strip(dirty) is False
    assert outputs_present([dirty, clean]) == []
    stripped = nbformat.read(str(dirty), as_version=4)
    assert "widgets" not in stripped.metadata and "execution" not in stripped.cells[2].metadata
    assert stripped.cells[1].metadata["tags"] == ["parameters"]  # tags survive


def test_lint(tmp_path: Path) -> None:
    assert lint(_write(_solution_notebook(), tmp_path / "ok.ipynb")) == []
    nb = _solution_notebook()
    nb.cells[1].metadata["tags"] = []
    nb.metadata["kernelspec"]["name"] = "my-venv"
    problems = lint(_write(nb, tmp_path / "bad.ipynb"))
    assert len(problems) == 2
    assert "0 cells tagged 'parameters'" in problems[0] and "'my-venv'" in problems[1]


# ------------------------------------------------------------------ run until the first stub


def test_stub_error_is_recognised_when_a_worker_re_raises_it() -> None:
    assert is_stub_error("NotImplementedError", "Exercise: do it (about 2 lines)", [])
    assert is_stub_error(
        "ProcessRaisedException", "\n\n-- Process 0 terminated...\nNotImplementedError: Exercise: x", []
    )
    assert not is_stub_error("NotImplementedError", "not an exercise", [])
    assert not is_stub_error("NameError", "name 'x' is not defined", [])


@pytest.fixture
def lab_dirs(tmp_path: Path, kernel_finds_labkit: None) -> tuple[Path, Path]:
    """A solutions/ and built labs/ pair; the kernel can import this checkout's labkit (tests/conftest.py)."""
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    _write(_solution_notebook(), solutions / "01_demo.ipynb")
    never = _solution_notebook()
    never.cells = [*never.cells[:2], nbformat.v4.new_code_cell("def later():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")]
    _write(never, solutions / "02_never.ipynb")
    build(solutions, labs)
    return solutions, labs


def test_run_until_stub(lab_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    solutions, labs = lab_dirs

    ok, message = run_until_stub(labs / "01_demo.ipynb", timeout=60)
    assert ok, message
    assert "cell 5" in message and "about 7 lines" in message

    ok, message = run_until_stub(solutions / "01_demo.ipynb", timeout=60)
    assert ok, message
    assert "no exercise stubs" in message

    executed = tmp_path / "out" / "early.ipynb"  # its folder is created
    ok, message = run_until_stub(
        labs / "01_demo.ipynb", parameters={"n": 0}, timeout=60, output_path=executed
    )
    assert not ok
    assert "cell 2 ('sizes = [1] * (6 // n)') raised ZeroDivisionError" in message
    assert executed.is_file()

    ok, message = run_until_stub(labs / "02_never.ipynb", timeout=60)
    assert not ok
    assert "without reaching an exercise stub" in message


def test_nbval_lax_runs_a_lab_as_a_test(repo: Path, labkit_env: dict[str, str], tmp_path: Path) -> None:
    """nbval runs a notebook as a test and checks only the cells marked for it (--nbval-lax)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",  # one notebook: no xdist workers (pyproject's addopts reach this pytest too)
            "--nbval-lax",
            str(repo / "solutions" / "00_cluster_tour.ipynb"),
        ],
        cwd=tmp_path,
        env=labkit_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
