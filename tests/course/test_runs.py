"""labkit.course.runs: each `labkit run` gets a folder of its own, and `latest` points to the newest."""

from __future__ import annotations

from labkit.course.runs import new_run_dir, point_latest


def test_each_run_gets_its_own_folder_and_latest_points_to_the_newest(tmp_path):
    first = new_run_dir(tmp_path)
    (first / "old.png").write_text("x")
    point_latest(tmp_path, first)
    second = new_run_dir(tmp_path)
    assert second != first and not any(second.iterdir())
    link = point_latest(tmp_path, second)
    assert link.resolve() == second.resolve() and not (link / "old.png").exists()
