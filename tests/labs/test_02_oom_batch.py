"""Lab 02, the batch that does not fit: its notebook, its script under torchrun, and the wrong answers to its
accumulation exercise."""

from __future__ import annotations

from typing import Any

import pytest

LAB = "02_oom_batch"


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 2) -> None:
    """Lab 02's records, wherever they were measured: the step as first written does not fit, the fixed one
    does (the emulated budget's bytes; a torchrun rank on CPUs counts them with a budget that only counts)."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    assert rec["unit"] == "MiB" and rec["after"] <= rec["limit"] < rec["before"]
    if torchrun:
        assert rec["fits"] is True and rec["peak_source"] == "emulated budget"


def test_the_solution_notebook_shows_the_lesson(run_solution, check_common):
    expect(run_solution(LAB), check_common)


def test_the_script_on_a_simulated_dgx_h100_node_fits_the_fixed_step_in_the_budget(simulated_lab):
    """Eight simulated H100s held to the lab's GPU budget (48 MiB above the baseline): the step as first
    written needs far more, the fixed one fits, counted from the tensors' sizes (OverlappedDDP stands in for
    torch DDP there, whose C++ reducer needs storage)."""
    rec = simulated_lab(LAB, 8)
    assert rec["where"] == "simulated H100-SXM5-80GB" and rec["grad_sync"] == "overlapped"
    assert rec["after"] <= rec["limit"] == 48.0 < rec["before"] and rec["fits"]
    assert rec["after"] == pytest.approx(rec["estimate_after_mib"], rel=0.15)


def test_the_lab_notebook_is_its_solution_up_to_the_first_exercise(lab_matches_solution):
    lab_matches_solution(LAB)


@pytest.mark.parametrize("n", [2, 4])
def test_the_script_under_torchrun(torchrun_lab, check_common, n):
    proc, rec = torchrun_lab(LAB, n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expect(rec, check_common, torchrun=True, world_size=n)


EXERCISE = ("def accumulate(ddp, batches)", "check_accumulation(fixed")
MISTAKES = {
    "forward outside no_sync": (
        {
            "        with ddp.no_sync():\n            (ddp(x, y) / n).backward()": "        loss = ddp(x, y) / n\n        with ddp.no_sync():\n            loss.backward()"
        },
        "its forward as well as its backward",
    ),
    "no_sync on every micro-step": (
        {
            "    x, y = batches[-1]\n    (ddp(x, y) / n).backward()": "    x, y = batches[-1]\n    with ddp.no_sync():\n        (ddp(x, y) / n).backward()"
        },
        "Run the last micro-batch outside",
    ),
    "last micro-batch forgotten": (
        {"    x, y = batches[-1]\n    (ddp(x, y) / n).backward()": ""},
        "7 forward passes for 8 micro-batches",
    ),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_wrong_answer_fails_at_its_check_with_its_hint(mutations_run, name):
    failed = mutations_run(LAB, *EXERCISE, {k: edits for k, (edits, _) in MISTAKES.items()})
    cell, error = failed[name]
    assert EXERCISE[1] in cell or EXERCISE[0] in cell, f"{name}: failed before its exercise: {error[-800:]}"
    assert MISTAKES[name][1] in error, f"{name}: the hint does not name the mistake: {error[-1500:]}"


def test_the_right_answer_passes_the_check(mutations_run):
    failed = mutations_run(LAB, *EXERCISE, {k: edits for k, (edits, _) in MISTAKES.items()})
    assert failed["the right answer"] == ("", ""), failed["the right answer"][1][-1500:]


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
