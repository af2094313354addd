"""labkit.course.grade (`labkit grade`): one learner finished lab 00, another left its exercise as the stub;
the table and the CSV say which checks pass for whom. `-p` values go to the labs that take them, checked
before any kernel starts; a failed check's hint is kept whole in the CSV and shortened at a word in the table;
each lab's end-to-end check is a check the grader grades (issue 28, point 11)."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.course import grade
from labkit.course.cli import EXIT_USAGE, main
from labkit.course.experiments.capstone import EXAM_SECRET_ENV
from labkit.course.grade import TABLE_STATUS_CHARS, LabGrade, check_cells, grade_folder

REPO = Path(__file__).resolve().parents[2]


def test_grade_reports_a_finished_and_an_unfinished_lab(tmp_path, repo, labkit_env):
    for learner, source in (("alice", "solutions"), ("bob", "labs")):
        (tmp_path / learner).mkdir()
        shutil.copy(repo / source / "00_cluster_tour.ipynb", tmp_path / learner / "00_cluster_tour.ipynb")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "labkit.course.cli",
            "grade",
            str(tmp_path),
            "--csv",
            str(tmp_path / "g.csv"),
            "-p",
            "sizes_kib",
            "[4, 256]",
            "-p",
            "iters",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=labkit_env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "g.csv")))
    status = {(r["learner"], r["check"]): r["status"] for r in rows}
    assert status[("alice", "check_sum_over_ranks")] == "pass"
    assert status[("bob", "check_sum_over_ranks")] == "not done"
    assert "alice" in out.stdout and "1/1" in out.stdout and "0/1" in out.stdout
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no lab notebooks"):
        grade_folder(tmp_path / "empty")
    with pytest.raises(ValueError, match="is not a folder"):
        grade_folder(tmp_path / "missing")


# ------------------------------------------------------------------ -p: each lab gets its own parameters


def _lab_folder(root, labs):
    """learner/<lab>.ipynb for each (learner, lab): never executed (the tests fake grade_notebook)."""
    for learner, lab in labs:
        (root / learner).mkdir(exist_ok=True)
        nbformat.write(nbformat.v4.new_notebook(), root / learner / f"{lab}.ipynb")
    return root


def _recorded(monkeypatch):
    calls = []

    def fake(path, learner, parameters=None, timeout_s=600):
        calls.append((learner, path.stem, dict(parameters)))
        return LabGrade(learner, path.stem)

    monkeypatch.setattr(grade, "grade_notebook", fake)
    return calls


def test_a_parameter_goes_only_to_the_labs_that_have_it(tmp_path, monkeypatch):
    # the instructor guide's `-p steps 1`: labs 01 and 04 take steps, lab 00 does not (papermill would warn
    # "Passed unknown parameter: steps" there, without saying which lab)
    calls = _recorded(monkeypatch)
    folder = _lab_folder(
        tmp_path,
        [("alice", "00_cluster_tour"), ("alice", "04_imbalanced_pipeline"), ("bob", "01_parallelism_choice")],
    )
    grade_folder(folder, {"cluster": "cpu", "steps": 1})
    assert calls == [
        ("alice", "00_cluster_tour", {"cluster": "cpu"}),
        ("alice", "04_imbalanced_pipeline", {"cluster": "cpu", "steps": 1}),
        ("bob", "01_parallelism_choice", {"cluster": "cpu", "steps": 1}),
    ]


def test_an_unreadable_exam_secret_is_refused_before_any_kernel(tmp_path, monkeypatch, capsys):
    # grade sets it in this process for its kernels: setenv makes monkeypatch put the unset variable back
    monkeypatch.setenv(EXAM_SECRET_ENV, "")
    calls = _recorded(monkeypatch)
    folder = _lab_folder(tmp_path, [("alice", "06_capstone")])
    assert main(["grade", str(folder), "--exam-secret", str(tmp_path / "nowhere.txt")]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and calls == [], err
    assert err[0].startswith(f"labkit grade: {EXAM_SECRET_ENV}=") and "cannot be read" in err[0]


def test_a_key_no_lab_graded_takes_is_refused_before_any_kernel(tmp_path, monkeypatch, capsys):
    calls = _recorded(monkeypatch)
    folder = _lab_folder(tmp_path, [("alice", "00_cluster_tour"), ("alice", "04_imbalanced_pipeline")])
    assert main(["grade", str(folder), "-p", "stepz", "1"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and calls == [], err
    line = err[0]
    assert line.startswith("labkit grade: stepz=1 must be a parameter of any of the labs graded (every lab: ")
    assert (
        "00_cluster_tour: world_size, sizes_kib, iters" in line and "04_imbalanced_pipeline: stages" in line
    )
    assert line.endswith("did you mean -p steps 1? (or leave -p stepz out)"), line
    # a key close to none: the fix is to leave it out, or one that exists
    assert main(["grade", str(folder), "-p", "xyz", "red"]) == EXIT_USAGE
    assert "leave -p xyz out, or set one of these parameters, e.g. -p " in capsys.readouterr().err
    # steps is none of lab 00's parameters: refused where lab 00 alone is graded, naming it and its parameters
    (tmp_path / "only00" / "carol").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "only00" / "carol" / "00_cluster_tour.ipynb")
    assert main(["grade", str(tmp_path / "only00"), "-p", "steps", "1"]) == EXIT_USAGE
    assert (
        "steps=1 must be a parameter of 00_cluster_tour, the lab graded (cluster, timeout_s, world_size, "
        in capsys.readouterr().err
    )
    assert calls == []


@pytest.mark.parametrize(
    "value,message",
    [
        ("0", "lab 04_imbalanced_pipeline: steps=0 must be a whole number with >= 1; set it with -p steps 3"),
        ("two", "lab 04_imbalanced_pipeline: steps='two' must be a whole number; set it with -p steps 3"),
    ],
)
def test_a_bad_value_is_refused_naming_the_lab(tmp_path, monkeypatch, capsys, value, message):
    calls = _recorded(monkeypatch)
    folder = _lab_folder(tmp_path, [("alice", "00_cluster_tour"), ("alice", "04_imbalanced_pipeline")])
    assert main(["grade", str(folder), "-p", "steps", value]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == f"labkit grade: {message}" and calls == []


# ------------------------------------------------------------- the failure text, the end-to-end checks

LONG_HINT = (
    "the stages are imbalanced because the split was taken by layer count; "
    + " ".join(f"word{i}" for i in range(70))
    + " hint: balance the measured costs with my_balance(costs, stages)."
)


def _check_cell(source: str) -> str:
    """The cell of solutions/04_imbalanced_pipeline.ipynb whose source starts with `source`."""
    nb = nbformat.read(REPO / "solutions" / "04_imbalanced_pipeline.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(source)]
    return cell.source


def _lab04_fixture(before_ms: float, after_ms: float, extra: list[str]) -> nbformat.NotebookNode:
    """A small lab 04 notebook: its parameters, made-up runs, and the solution's own end-to-end check cell."""
    params = nbformat.v4.new_code_cell('cluster = "auto"\nsteps = 3', metadata={"tags": ["parameters"]})
    setup = nbformat.v4.new_code_cell(
        "from types import SimpleNamespace\n"
        "from labkit.course import lab04\n"
        "def run(step_ms):\n"
        "    return SimpleNamespace(step_ms=step_ms, limit_ms=90.0, imbalance=1.1, grad_error=1e-7,\n"
        "                           loss_error=1e-7, sizes=[7, 6, 6, 7], micro_batches=8, bubble=0.3,\n"
        "                           bubble_formula=0.27)\n"
        f"measured = {{'before': run({before_ms}), 'balanced, few micro-batches': run(130.0),\n"
        f"            'after': run({after_ms})}}\n"
        "before, after = measured['before'], measured['after']\n"
        "label = 'emulated'\n"
        "machine = SimpleNamespace(computes_values=True, judged_by_verdict=False)  # the emulated cluster"
    )
    check = nbformat.v4.new_code_cell(_check_cell("# The check. Gradients must be the model's;"))
    nb = nbformat.v4.new_notebook(cells=[params, setup, check, *map(nbformat.v4.new_code_cell, extra)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def test_grade_passes_each_lab_its_parameters_reports_lab_04s_end_to_end_check_and_keeps_hints_whole(
    tmp_path, labkit_env
):
    # alice: lab 00 (no steps) and a lab 04 whose end-to-end check passes, with steps 1 arriving and a check
    # whose hint is longer than 300 characters; bob: a lab 04 whose balanced step is slower than the naive one
    lab00 = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell('cluster = "auto"', metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell("def check_no_steps():\n    assert 'steps' not in globals()"),
            nbformat.v4.new_code_cell("check_no_steps()"),
        ]
    )
    lab00.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    extra = [
        "def check_steps(given):\n    assert given == 1, f'steps={given}'",
        "check_steps(steps)",
        f"def check_hint():\n    raise AssertionError({LONG_HINT!r} + '\\n\\nsecond paragraph: details')",
        "check_hint()",
    ]
    for learner, name, nb in (
        ("alice", "00_cluster_tour", lab00),
        ("alice", "04_imbalanced_pipeline", _lab04_fixture(150.0, 100.0, extra)),
        ("bob", "04_imbalanced_pipeline", _lab04_fixture(110.0, 115.0, [])),
    ):
        (tmp_path / learner).mkdir(exist_ok=True)
        nbformat.write(nb, tmp_path / learner / f"{name}.ipynb")
    csv_path = tmp_path / "grades.csv"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "labkit.course.cli",
            "grade",
            str(tmp_path),
            "--csv",
            str(csv_path),
            "-p",
            "steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=labkit_env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Passed unknown parameter" not in out.stderr, out.stderr[-2000:]
    status = {(r["learner"], r["lab"][:2], r["check"]): r["status"] for r in csv.DictReader(open(csv_path))}
    assert status[("alice", "00", "check_no_steps")] == "pass"
    assert status[("alice", "04", "check_steps")] == "pass"
    # lab 04's end-to-end check is graded: it passes for alice and fails for bob with its numbers and hint
    assert status[("alice", "04", "check_pipeline")] == "pass"
    assert status[("bob", "04", "check_pipeline")] == (
        "fail: AssertionError: after 115 ms, before 110 ms, limit 90 ms (split [7, 6, 6, 7], m=8): after "
        "must beat before and cannot beat the limit; hint: is the split from my_balance(costs, stages) on "
        "the costs measured at the chosen micro-batch size?"
    )
    # the CSV keeps the whole first paragraph; the table shortens it at a word, and says where it is whole
    assert len(LONG_HINT) > 300
    assert status[("alice", "04", "check_hint")] == f"fail: AssertionError: {LONG_HINT}"
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("alice") and "04_imbalanced" in x]
    shown = line.split("check_hint: ", 1)[1].split("…", 1)[0]
    full = f"fail: AssertionError: {LONG_HINT}"
    assert full.startswith(shown) and full[len(shown)] == " " and len(shown) < TABLE_STATUS_CHARS, shown
    assert f"{csv_path} has each one whole" in out.stdout


def test_each_lab_s_end_to_end_check_is_a_check_the_grader_grades(repo):
    # the survey (issue 28): every lab's end-to-end check calls a check_ function, so that `labkit grade`
    # reports it; a cell headed "# The check" that asserts by itself would be invisible to it
    ends = {
        "01_parallelism_choice": "check_planner_pick",
        "02_oom_batch": "check_memory_fix",
        "03_unoverlapped_comms": "check_overlapped_step",
        "04_imbalanced_pipeline": "check_pipeline",
        "05_unprofiled_run": "check_mystery_fix",
        "06_capstone": "check_capstone",
    }
    for folder in ("solutions", "labs"):
        for lab, name in ends.items():
            nb = nbformat.read(repo / folder / f"{lab}.ipynb", as_version=4)
            graded = dict((i, n) for i, n in check_cells(nb))
            assert name in graded.values(), (folder, lab, graded)
            for i, cell in enumerate(nb.cells):
                if cell.cell_type == "code" and cell.source.startswith("# The check"):
                    assert i in graded and not re.search(r"^\s*assert\b", cell.source, re.M), (folder, lab, i)
