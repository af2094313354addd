"""Lab 02, the batch that does not fit: its notebook, its script under torchrun, and the wrong answers to its
accumulation exercise."""

from __future__ import annotations

from typing import Any

import pytest

LAB = "02_oom_batch"
GPU_MEMORY_MIB = 64.0  # Params.GPU_SIZES: the 48 MiB of the one H200 run left no large segment spare


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 2) -> None:
    """Lab 02's records, wherever they were measured: the step as first written does not fit, the fixed one
    does (the emulated budget's bytes; a torchrun rank on CPUs counts them with a budget that only counts)."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    assert rec["unit"] == "MiB" and rec["after"] <= rec["limit"] < rec["before"]
    if torchrun:
        assert rec["fits"] is True and rec["peak_source"] == "emulated budget"


def test_the_solution_notebook_shows_the_lesson(run_solution, check_common):
    expect(run_solution(LAB), check_common)


def test_the_notebook_on_a_simulated_node_checks_gradients_emulated_and_fits_the_fixed_step(run_solution):
    """cluster="sim:dgx-h100", 2 ranks at the GPU sizes (64 MiB each, 64 sequences per rank): the step as first
    written runs out of the simulated card's budget, the accumulation exercise is checked on the emulated
    cluster at the same sizes, and the estimate meets the measured peaks once OverlappedDDP's buckets (a
    second copy of the gradients, which torch DDP does not keep) are counted."""
    rec = run_solution(LAB, cluster="sim:dgx-h100")
    assert rec["limit"] == GPU_MEMORY_MIB and rec["after"] <= rec["limit"] < rec["before"]
    assert rec["fixed_step"]["micro_batch"] == 32 and rec["grad_max_abs_error"] < 1e-6
    for ratio in rec["estimate_over_measured"].values():
        assert ratio == pytest.approx(1, abs=0.02)
    assert rec["allreduces_per_step_without_no_sync"] == 16 * rec["allreduces_per_step_no_sync"]


@pytest.mark.fake_cuda
def test_the_notebooks_gpu_branch_runs_out_then_fits_the_fixed_step_with_a_large_segment_to_spare(
    run_on_fake_cuda,
):
    """The notebook's real-GPU branch on CI's fake CUDA machine (torch.cuda's memory API on labkit's model of
    the caching allocator) at lab 02's GPU sizes: the step as written runs out with CUDA's message, the fixed
    step fits under the cap on *reserved* memory with one large segment (20 MiB) to spare, which the 48 MiB cap
    of the one H200 run did not leave ("Tried to allocate 20.00 MiB"), and the estimate meets the measured
    peaks with the machine's for-each Adam counted."""
    from labkit.course.experiments.oom_batch import Params
    from labkit.machine.machine import LARGE_SEGMENT_BYTES

    # one GPU, as on the H200 the lab ran out on (Params.ranks_on(1): one rank, DDP still buckets)
    sizes = {"memory_mib": Params.GPU_SIZES["memory_mib"], "global_batch": Params.GPU_SEQUENCES_PER_RANK}
    rec, text = run_on_fake_cuda(LAB, gpus=1, **sizes)
    assert rec["params"]["world_size"] == 1
    assert rec["machine"] == "gpu" and rec["where"] == "emulated, fake CUDA" and rec["emulated"] is False
    assert "CUDA out of memory. Tried to allocate" in text and "set_per_process_memory_fraction" in text
    assert rec["after"] <= rec["limit"] < rec["before"] and rec["fixed_step"]["accumulation_steps"] > 1
    assert rec["limit"] - rec["reserved_peak_after_mib"] >= LARGE_SEGMENT_BYTES / 2**20
    for ratio in rec["estimate_over_measured"].values():
        assert ratio == pytest.approx(1, abs=0.05)
    assert (
        rec["allreduces_per_step_without_no_sync"] > rec["allreduces_per_step_no_sync"] == rec["ddp_buckets"]
    )


def test_the_lab_notebook_is_its_solution_up_to_the_first_exercise(lab_matches_solution):
    lab_matches_solution(LAB)


@pytest.mark.parametrize("n", [2])  # one size: labs 01 and 04, whose layouts and stages differ, run both
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


def test_the_check_after_a_failed_exercise_cell_never_shows_an_earlier_attempts_hint(mutations_run):
    """Issue 44: the second wrong answer fails in the exercise cell itself; the check cell, run next, must
    say so instead of checking the first attempt's results (whose hint named another mistake)."""
    failed = mutations_run(LAB, *EXERCISE, {k: edits for k, (edits, _) in MISTAKES.items()})
    assert "7 forward passes for 8 micro-batches" in failed["last micro-batch forgotten"][1]
    cell, error = failed["last micro-batch forgotten, then its check"]
    assert EXERCISE[1] in cell and "the exercise cell above did not finish" in error, error[-1500:]
    assert MISTAKES["no_sync on every micro-step"][1] not in error, error[-1500:]


def test_the_right_answer_passes_the_check(mutations_run):
    failed = mutations_run(LAB, *EXERCISE, {k: edits for k, (edits, _) in MISTAKES.items()})
    assert failed["the right answer"] == ("", ""), failed["the right answer"][1][-1500:]


@pytest.mark.gpu
def test_the_solution_notebook_on_the_gpus_there_are(gpu_notebook, check_common):
    """On real GPUs at the GPU sizes: the lesson, as on the fake CUDA machine (the step as written runs out,
    the fixed one fits with a large segment spare, the estimate within 10 % of the measured peaks)."""
    from labkit.machine.machine import LARGE_SEGMENT_BYTES

    rec = gpu_notebook(LAB, cluster="gpu")
    check_common(rec, LAB, torchrun=False, world_size=0)
    assert rec["emulated"] is False and rec["machine"] == "gpu"
    assert rec["after"] <= rec["limit"] < rec["before"] and rec["fixed_step"]["accumulation_steps"] > 1
    assert rec["limit"] - rec["reserved_peak_after_mib"] >= LARGE_SEGMENT_BYTES / 2**20
    for ratio in rec["estimate_over_measured"].values():
        assert ratio == pytest.approx(1, abs=0.10)


@pytest.mark.gpu
def test_the_script_under_torchrun_on_the_gpus_there_are(gpu_torchrun, check_common):
    check_common(gpu_torchrun(LAB), LAB, torchrun=False, world_size=0)
