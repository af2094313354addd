"""tests/gpu_rows.py and tests/gpu_check.sh, without a GPU: the one-rank rows on the emulated cluster at the
labs' emulated sizes (so that they do not rot between the rare runs on a GPU; the forecast row skips), the
check's plan (its worst case fits a lent node's 10 minutes, and --plan runs nothing), and the helpers that
turn a step's junit file, log and exit status into rows and the rows into one Markdown table."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _gpu_rows():
    spec = importlib.util.spec_from_file_location("gpu_rows", HERE / "gpu_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_rows = _gpu_rows()


def test_every_one_rank_row_runs_and_passes_on_the_emulated_cluster(capsys, tmp_path):
    rows_file = tmp_path / "rows.rows.jsonl"
    assert gpu_rows.main(str(rows_file)) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    table = out.split("\none rank on emulated")[-1]  # after the rows the rank printed as each finished
    assert table.count(" passed ") == len(gpu_rows.ROWS) + 1, out
    # each row was kept as it finished, for the summary (and for a step stopped at its limit)
    kept = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["result"] for r in kept] == ["passed"] * (len(gpu_rows.ROWS) + 1)
    assert {r["step"] for r in kept} == {"rows"}


# ------------------------------------------------------------------ the plan


def _plan(tmp_path: Path, *steps: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`gpu_check.sh --plan`, with a Python that only writes down that it ran."""
    ran = tmp_path / "python_ran"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\n")
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_LOGS": str(logs)}
    done = subprocess.run(
        ["bash", str(HERE / "gpu_check.sh"), "--plan", *steps], env=env, capture_output=True, text=True
    )
    return done, ran, logs


def test_the_plan_fits_a_lent_node_and_runs_nothing(tmp_path):
    done, ran, logs = _plan(tmp_path)
    assert done.returncode == 0, done.stderr
    worst = int(re.search(r"^worst case +(\d+) s", done.stdout, re.M).group(1))
    limits = [int(n) for n in re.findall(r"^(?:after each|\S+) +(\d+) s ", done.stdout, re.M)]
    assert worst <= 600 and worst == sum(limits), done.stdout  # the steps, after each, the summary
    assert not ran.exists() and not logs.exists()  # nothing ran, no folder was made
    # every test module with tests marked gpu is in a step
    marked = {
        str(p.relative_to(ROOT))
        for p in HERE.rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text(encoding="utf-8"))
    }
    planned = set(re.findall(r"tests/\S+\.py", done.stdout)) - {"tests/gpu_rows.py"}
    assert marked and marked <= planned, marked - planned


def test_the_plan_of_some_steps_has_the_preflight_first_and_a_wrong_name_is_refused(tmp_path):
    done, _, _ = _plan(tmp_path, "lab06", "rows")
    steps = re.findall(r"^(\S+) +\d+ s ", done.stdout, re.M)
    assert steps == ["preflight", "rows", "lab06", "summary"], done.stdout
    done, ran, _ = _plan(tmp_path, "lab6")
    assert done.returncode == 2 and "no step lab6" in done.stderr and "lab06" in done.stderr
    assert not ran.exists()


# ------------------------------------------------------------------ rows and the table


def test_the_summary_is_one_markdown_table(tmp_path, capsys):
    rows = [
        gpu_rows.row("core", "test_launcher::test_nccl_all_reduce[1]", "passed", 3.14159),
        gpu_rows.row("lab05", "(the step)", "timeout", 45, "over its limit | at x.py:9\nthe log's tail"),
        gpu_rows.row("lab00", "test_00::test_script", "skipped", 0, "needs 2 ranks, 1 GPU(s) here"),
    ]
    assert gpu_rows.markdown_table(rows).splitlines() == [
        "| step | check | result | s | reason |",
        "| --- | --- | --- | ---: | --- |",
        "| core | test_launcher::test_nccl_all_reduce[1] | passed | 3.1 |  |",
        "| lab05 | (the step) | timeout | 45.0 | over its limit \\| at x.py:9 |",  # one line, | escaped
        "| lab00 | test_00::test_script | skipped | 0.0 | needs 2 ranks, 1 GPU(s) here |",
    ]
    (tmp_path / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_rows.summary(tmp_path) == 1  # a timeout fails the run
    out = capsys.readouterr().out
    assert out.startswith("| step | check |") and "1 passed, 0 failed, 1 timeout, 1 skipped" in out
    assert (tmp_path / "summary.md").read_text() == out
    with pytest.raises(ValueError, match="result 'ok' is not one of"):
        gpu_rows.row("core", "x", "ok", 0)


def test_an_error_keeps_a_readable_first_line_in_the_table_and_its_whole_text_in_the_detail():
    message = "RuntimeError: " + "the first line of a long error, " * 8 + "end\nsecond line\nthird line"
    r = gpu_rows.row("rows", "lab 02", "failed", 1.0, message)
    assert r["detail"] == message and "\n" not in r["reason"]
    assert 70 < len(r["reason"]) <= gpu_rows.WIDTH and r["reason"].endswith("...")  # no longer cut at 70
    assert gpu_rows.first_line("\n  short one  \nnext") == "short one"


def test_an_oom_row_shows_allocated_reserved_and_the_largest_free_block():
    MiB = gpu_rows.MiB
    stats = {"allocated_bytes.all.current": 1500 * MiB, "reserved_bytes.all.current": 1600 * MiB}
    segments = [  # torch.cuda.memory_snapshot()'s shape: free ("inactive") blocks between used ones
        {"blocks": [{"size": 20 * MiB, "state": "active_allocated"}, {"size": 6 * MiB, "state": "inactive"}]},
        {"blocks": [{"size": 14 * MiB, "state": "inactive"},
                    {"size": 2 * MiB, "state": "active_pending_free"}]},
    ]
    figures = gpu_rows.memory_figures(stats, segments)
    assert figures == {"allocated": 1500 * MiB, "reserved": 1600 * MiB, "largest_free": 14 * MiB}
    message = (
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "139.81 GiB of which 1.50 MiB is free. Including non-PyTorch memory, this process has 139.80 GiB "
        "memory in use.\nIf reserved but unallocated memory is large try setting expandable_segments"
    )
    reason = gpu_rows.oom_reason(message, figures, "/tmp/logs/oom_lab_02_under_the_cap.pickle")
    r = gpu_rows.row("rows", "lab 02: under the cap", "failed", 2.0, reason, message, 4 * gpu_rows.WIDTH)
    assert r["reason"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.")
    assert r["reason"].endswith(
        " | allocated 1,500.0 MiB, reserved 1,600.0 MiB, largest free block 14.0 MiB; "
        "memory snapshot oom_lab_02_under_the_cap.pickle"
    )
    assert "expandable_segments" not in r["reason"] and "expandable_segments" in r["detail"]
    assert gpu_rows.row_line(r).startswith("  failed      2.0 s  lab 02: under the cap: OutOfMemoryError")


# ------------------------------------------------------------------ a finished step's rows


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.labs.test_05_unprofiled_run" name="test_one" time="12.5" />
<testcase classname="tests.labs.test_05_unprofiled_run" name="test_two" time="3.0">
<failure message="AssertionError: {long}&#10;assert 1 == 2">tests/labs/test_05.py:9: in test_two
E   AssertionError: {long}</failure></testcase>
<testcase time="0.000" />
</testsuite></testsuites>"""

LOG = """tests/labs/test_05_unprofiled_run.py::test_one PASSED                 [ 33%]
tests/labs/test_05_unprofiled_run.py::test_two FAILED                 [ 66%]
tests/labs/test_05_unprofiled_run.py::test_three Timeout (0:00:20)!
Thread 0x00007f52ffffbb80 (most recent call first):
  File "/usr/lib/python3.11/subprocess.py", line 1264 in wait
  File "/repo/tests/labs/conftest.py", line 261 in run
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
/repo/tests/labs/test_05_unprofiled_run.py:143: KeyboardInterrupt
"""


def test_a_step_stopped_at_its_limit_keeps_its_finished_tests_and_names_the_running_one(tmp_path):
    long = "the notebook's check says " + "why " * 40
    (tmp_path / "lab05.xml").write_text(JUNIT.format(long=long))
    (tmp_path / "lab05.log").write_text(LOG)
    rows = gpu_rows.step_rows(tmp_path, "lab05", 124, 30.0, 45)
    assert [(r["check"], r["result"]) for r in rows] == [
        ("test_05_unprofiled_run::test_one", "passed"),
        ("test_05_unprofiled_run::test_two", "failed"),
        ("(the step)", "timeout"),
    ]
    assert rows[1]["reason"].startswith("AssertionError: the notebook's check says why why")
    assert len(rows[1]["reason"]) > 70 and long.strip() in rows[1]["detail"]
    assert rows[2]["reason"] == (
        "over its limit: interrupted (SIGINT) at 30 s, while running "
        "tests/labs/test_05_unprofiled_run.py::test_three (at /repo/tests/labs/test_05_unprofiled_run.py:143)"
    )


def test_a_step_killed_without_a_report_is_explained_from_its_log(tmp_path):
    # KILLed 15 s after SIGINT (pytest wrote no junit file): the log's faulthandler dump says where it was
    (tmp_path / "lab06.log").write_text(LOG.split("!!!")[0])
    (r,) = gpu_rows.step_rows(tmp_path, "lab06", 137, 70.0, 70)
    assert r["result"] == "timeout" and r["reason"] == (
        "over its limit: killed at 70 s (15 s after SIGINT, which it did not end on), while running "
        "tests/labs/test_05_unprofiled_run.py::test_three (at /repo/tests/labs/conftest.py:261 in run)"
    )
    assert "subprocess.py" in r["detail"]  # the log's tail


def test_a_step_that_fails_without_a_failed_row_gets_one_and_an_empty_step_a_result(tmp_path, capsys):
    (tmp_path / "preflight.log").write_text("doctor ...\nNOT READY: the 2-rank all-reduce failed\n")
    (r,) = gpu_rows.step_rows(tmp_path, "preflight", 1, 20.0, 45)
    assert r["result"] == "failed" and r["reason"] == "exit status 1: NOT READY: the 2-rank all-reduce failed"
    (r,) = gpu_rows.step_rows(tmp_path, "core", 5, 8.0, 60)
    assert (r["result"], r["reason"]) == ("skipped", "no test marked gpu ran")
    assert gpu_rows.report_step(tmp_path, "preflight", 1, 20.0, 45, show_log=True) == 1
    out = capsys.readouterr().out
    assert out.startswith("doctor ...\nNOT READY") and "exit status 1 after 20 s (limit 45 s)" in out
    kept = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == ["preflight"]


# ------------------------------------------------------------------ the preflight and leftovers


@pytest.mark.skipif(torch.cuda.is_available(), reason="the preflight of a machine without a GPU")
def test_the_preflight_says_why_the_checks_cannot_run_here_and_flags_an_old_torch(
    tmp_path, monkeypatch, capsys
):
    assert gpu_rows.preflight(tmp_path) == 2
    assert "no GPU torch can use" in (tmp_path / "stop").read_text()
    lines = (tmp_path / "preflight.rows.jsonl").read_text().splitlines()
    rows = {r["check"]: r for r in map(json.loads, lines)}
    assert rows["a GPU torch can use"]["result"] == "failed" and "torch version" in rows
    assert "labkit.machine._torch_compat.problems()" in rows and "OLDER" not in capsys.readouterr().out
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")  # the last lent H200's
    (tmp_path / "old").mkdir()
    gpu_rows.preflight(tmp_path / "old")
    assert "!!! torch 2.11.0+cu128 is OLDER than labkit needs (torch>=2.13" in capsys.readouterr().out
    old = [json.loads(line) for line in (tmp_path / "old" / "preflight.rows.jsonl").read_text().splitlines()]
    assert next(r for r in old if r["check"] == "torch version")["result"] == "failed"


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_what_a_step_left_running_is_ended_and_nothing_else(tmp_path):
    marker = f"test.{os.getpid()}"
    code = "import time; time.sleep(600)"
    # a rank or kernel that started a session of its own still carries the step's marker
    orphan = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "GPU_CHECK_STEP": marker}, start_new_session=True
    )
    other = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        found = gpu_rows.end_leftovers(0, marker)
        assert list(found) == [orphan.pid] and "time.sleep(600)" in found[orphan.pid]
        assert orphan.wait(timeout=30) != 0 and other.poll() is None
    finally:
        for proc in (orphan, other):
            proc.kill()
            proc.wait()
