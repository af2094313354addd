"""Lab 06, the capstone: its notebook (seed 0: the batch does not fit, gradients all-reduced one by one, a
slow tokenizer) and its script under torchrun. Its check, `check_capstone`, is tested in
tests/experiments/test_capstone_checks.py."""

from __future__ import annotations

from typing import Any

import pytest

LAB = "06_capstone"


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 2) -> None:
    """Lab 06's records, wherever they were measured."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    assert rec["unit"] == "ms" and rec["seed"] == 0 and rec["oom_at_start"] and "oom_batch" in rec["found"]
    assert rec["peak_mib"]["fixed"] <= rec["peak_mib"]["memory"]
    if rec["emulated"]:
        assert rec["found"] == ["data_loading", "oom_batch", "per_tensor_allreduce"]
        assert rec["after"] < rec["before"] and rec["after"] <= 1.2 * rec["limit"]
    if "rows" in rec:  # the notebook: the check's rows
        assert len(rec["rows"]) == 3 and all(r["found"] and r["fixed"] for r in rec["rows"])
    if torchrun:
        assert rec["job_fixed"]["global_batch"] == 8 * world_size  # the contract kept


def test_the_solution_notebook_shows_the_lesson(run_solution, check_common):
    expect(run_solution(LAB), check_common)


def test_the_lab_notebook_is_its_solution_up_to_the_first_exercise(lab_matches_solution):
    lab_matches_solution(LAB)


@pytest.mark.parametrize("n", [2, 4])
def test_the_script_under_torchrun(torchrun_lab, check_common, n):
    proc, rec = torchrun_lab(LAB, n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expect(rec, check_common, torchrun=True, world_size=n)


@pytest.mark.gpu
def test_the_solution_notebook_on_the_gpus_there_are(gpu_notebook, check_common):
    rec = gpu_notebook(LAB)
    if rec["emulated"]:  # fewer GPUs than the lab's ranks: "auto" ran it on the emulated cluster
        expect(rec, check_common)
    else:
        check_common(rec, LAB, torchrun=False, world_size=0)


@pytest.mark.gpu
def test_the_script_under_torchrun_on_the_gpus_there_are(gpu_torchrun, check_common):
    check_common(gpu_torchrun(LAB), LAB, torchrun=False, world_size=0)
