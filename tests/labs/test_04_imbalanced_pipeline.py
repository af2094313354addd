"""Lab 04, the imbalanced pipeline: its notebook, its script under torchrun, and the wrong answers to its
balancing exercise."""

from __future__ import annotations

from typing import Any

import pytest

LAB = "04_imbalanced_pipeline"


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 4) -> None:
    """Lab 04's records, wherever they were measured."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    assert rec["unit"] == "ms" and rec["max_abs_diff"] < 1e-5
    layers = rec["params"]["n_layers"] + 2  # the embedding, the blocks, the head
    assert sum(rec["sizes_after"]) == sum(rec["sizes_before"]) == layers
    if rec["emulated"]:  # virtual time: the lesson's targets, and the bubble formula as a model output
        assert rec["limit"] <= rec["after"] < rec["before"] and rec["after"] / rec["limit"] <= 1.3
        assert rec["imbalance_after"] < rec["imbalance_before"] and rec["sizes_after"] != rec["sizes_before"]
        assert rec["bubble_formula"] == 3 / 11 and rec["micro_batches"] == 8
    if "peak_mib_gpipe" in rec:  # the notebook: 1F1B saves memory, not time
        assert rec["peak_mib_gpipe"][0] > 1.3 * rec["peak_mib_1f1b"][0]
    if "peak_mib_interleaved" in rec and rec["emulated"]:  # rank 0 under interleaving: as its chunks predict
        measured = rec["peak_mib_interleaved"][0] / rec["peak_mib_1f1b"][0]
        assert abs(measured / rec["held_ratio_predicted"] - 1) < 0.15, (measured, rec["held_ratio_predicted"])


def test_the_solution_notebook_shows_the_lesson(run_solution, check_common):
    expect(run_solution(LAB), check_common)


def test_the_notebook_on_a_simulated_node_checks_gradients_emulated_and_times_the_gpu_sizes(run_solution):
    """cluster="sim:dgx-h100", four stages: the pipeline's gradients are checked against one process on the
    emulated cluster at its sizes; every plan runs at the GPU sizes but with 8 blocks on the simulated node,
    where no values are compared, and the lesson shows there (one timed step there; a simulated operator costs
    its dispatch, whatever its size, so the time follows the blocks: 16, the GPU default, 75 s on the 2-core
    VM, 8 blocks 51 s, where the head is a larger share of a stage: after/before 0.66)."""
    rec = run_solution(LAB, cluster="sim:dgx-h100", n_layers=8)
    assert rec["params"]["d_model"] == 1024 and rec["emulated"] and rec["max_abs_diff"] is None
    assert rec["params"]["vocab_size"] == 32768 and rec["sizes_after"] != rec["sizes_before"]
    assert rec["after"] / rec["before"] <= 0.8 and rec["after"] / rec["limit"] <= 1.2
    assert rec["peak_mib_gpipe"][0] > 1.3 * rec["peak_mib_1f1b"][0]


# Four stages on CI's fake CUDA machine: a heavier head (a 12 K vocabulary on a 128-wide GPT: about 3 blocks'
# work there) and fewer, wider blocks than the emulated defaults. The fake's memory model sees every operator
# (a Python dispatch mode: some 50 us per operator stay on the rank's clock, its counting off it), so 64-wide
# layers are launch-bound there as on a GPU at toy sizes, and more micro-batches only cost more
FAKE_CUDA_SIZES = {"d_model": 128, "n_layers": 8, "vocab_size": 12288, "global_batch": 16, "steps": 2}


@pytest.mark.fake_cuda
def test_the_gpu_branch_on_fake_cuda_evens_the_stages_and_prints_the_verdict_its_numbers_call_for(
    run_on_fake_cuda, check_verdict
):
    """The notebook's real-GPU branch on four fake H100s (labkit.machine.emulate.fake_cuda), one stage each: the
    gradients are checked against one process, the balanced split evens the stages' times, 1F1B holds less
    than GPipe (read through torch.cuda's memory API), and the
    GPU branch prints the course's verdict on its numbers (labkit.course.forecast.verdict). after/before measured 0.69
    and 0.87 on the 2-core VM, under the course's 0.8 or not, so the verdict is checked against the numbers,
    not for a pass."""
    rec, text = run_on_fake_cuda(LAB, gpus=4, interleaved=False, **FAKE_CUDA_SIZES)
    assert rec["machine"] == "gpu" and rec["where"] == "emulated, fake CUDA" and rec["emulated"] is False
    assert rec["params"]["stages"] == 4 and rec["max_abs_diff"] < 1e-5
    # Not after < before: compute here is the CPU time of Python-heavy toy operators on four ranks sharing
    # 2 cores, and after/before spread from 0.69 to 1.04 over three runs; the stage times must be closer
    assert rec["imbalance_after"] < rec["imbalance_before"], (rec["imbalance_before"], rec["imbalance_after"])
    assert rec["peak_mib_gpipe"][0] > 1.3 * rec["peak_mib_1f1b"][0]
    check_verdict(rec, text)


def test_the_lab_notebook_is_its_solution_up_to_the_first_exercise(lab_matches_solution):
    lab_matches_solution(LAB)


def test_the_script_under_torchrun(torchrun_lab, check_common):
    # four stages, the lab's default; torchrun's wall-clock ranks check the plumbing, not the lesson: two
    # stages run on the emulated cluster in tests/course/experiments/test_imbalanced_pipeline.py
    proc, rec = torchrun_lab(LAB, 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expect(rec, check_common, torchrun=True, world_size=4)


_DP = ("    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]", "    return sizes[::-1]")
_GREEDY = """    target, sizes, count, total = sum(costs) / stages, [], 0, 0.0
    for i, c in enumerate(costs):
        if count and total + c > target and len(sizes) < stages - 1:
            sizes.append(count)
            count, total = 0, 0.0
        count, total = count + 1, total + c
    return sizes + [count]"""
_EVEN = "    return [n // stages + (1 if s < n % stages else 0) for s in range(stages)]"
EXERCISE = ("def my_balance(costs, stages)", "check_balance(my_balance")
MISTAKES = {
    "greedy split": ({_DP: _GREEDY}, "greedy"),
    "split by layer count": ({_DP: _EVEN}, "split by layer count"),
    "cut positions returned": (
        {
            "    return sizes[::-1]": "    out, total = [], 0\n    for k in sizes[::-1]:\n        total += k\n        out.append(total)\n    return out"
        },
        "cut positions",
    ),
    "sum minimised instead of the bottleneck": (
        {
            "value = max(best[k - 1][j], prefix[i] - prefix[j])": "value = best[k - 1][j] + prefix[i] - prefix[j]"
        },
        "not a sum",
    ),
    "empty stages allowed": (
        {
            "        for i in range(k, n - (stages - k) + 1):\n            for j in range(k - 1, i):": "        for i in range(n + 1):\n            for j in range(i + 1):"
        },
        "at least one layer",
    ),
    "bad input not refused": (
        {
            "    if stages > n:\n        raise ValueError(": "    if False:\n        raise ValueError(",
            '            raise ValueError(f"costs[{i}]': '            pass  # (f"costs[{i}]',
        },
        "raise ValueError",
    ),
    "labkit's own answer": (
        {_DP: "    from labkit.pipeline_plan import balance\n\n    return balance(costs, stages)"},
        "labkit.pipeline_plan.balance, labkit's own answer",
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
