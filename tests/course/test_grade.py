"""labkit.course.grade (`labkit grade`): one learner finished lab 00, another left its exercise as the stub;
the table and the CSV say which checks pass for whom."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys

import pytest

from labkit.course.grade import grade_folder


def test_grade_reports_a_finished_and_an_unfinished_lab(tmp_path, repo, labkit_env):
    for learner, source in (("alice", "solutions"), ("bob", "labs")):
        (tmp_path / learner).mkdir()
        shutil.copy(repo / source / "00_cluster_tour.ipynb", tmp_path / learner / "00_cluster_tour.ipynb")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "labkit.cli",
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
