"""Lab 06, the capstone: its notebook (seed 0: the batch does not fit, gradients all-reduced one by one, a
slow tokenizer), its script under torchrun; both on a simulated node. Its check, `check_capstone`, is tested in
tests/course/experiments/test_capstone_checks.py."""

from __future__ import annotations

from typing import Any

import pytest

from labkit.course.experiments.capstone import draw
from labkit.course.experiments.capstone_checks import SLOWER_OK

LAB = "06_capstone"


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 2) -> None:
    """Lab 06's records, wherever they were measured."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    assert rec["unit"] == "ms" and rec["seed"] == 0 and rec["oom_at_start"] and "oom_batch" in rec["found"]
    assert rec["peak_mib"]["fixed"] <= rec["peak_mib"]["memory"]
    # the rounds name the mistakes as `found` does, and after against the clean job (a reference) is said
    assert {r["round"].removesuffix(" fixed") for r in rec["rounds"][1:]} <= set(rec["found"])
    under = rec["after"] < rec["limit"]
    assert ("under the clean job" in rec["versus_clean"]) == under and rec["clean_spread_ms"] >= 0
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


def test_the_script_under_torchrun(torchrun_lab, check_common):
    # two ranks only (four took 16-19 s of the suite's 14 minutes): lab 05's torchrun test runs the same
    # training jobs (labkit.course.training.loop.train_jobs) on four
    proc, rec = torchrun_lab(LAB, 2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expect(rec, check_common, torchrun=True, world_size=2)


def test_the_notebook_on_a_simulated_node_finds_and_fixes_the_oom_and_the_straggler(run_solution):
    """cluster="sim:dgx-h100" (one timed step, two traced: 45 s alone on the 2-core VM): the exercises are the
    memory formula and the knobs, so they run as anywhere; the jobs and the check run on two simulated H100s.
    The traces name the straggler, not the optimizer's .item()s on its CPU step counters, and its fix takes
    the step to the clean job's: 8.78 -> 7.04 ms, x0.80, a hair above the share target's 0.8 (4 ranks: x0.70).
    The script does the same there (tests/course/experiments/test_capstone.py checks that it deals it; the suite's
    time keeps it to the notebook)."""
    rec = run_solution(LAB, cluster="sim:dgx-h100", steps=1, trace_steps=2)
    assert rec["found"] == ["oom_batch", "straggler"] and rec["oom_at_start"]
    assert [r["mistake"] for r in rec["rows"]] == ["oom_batch", "straggler"]
    assert all(r["found"] and r["fixed"] for r in rec["rows"])
    assert rec["after"] == pytest.approx(rec["limit"]) and rec["after"] / rec["before"] < 0.81
    assert "simulated H100-SXM5-80GB" in rec["versus_clean"]


@pytest.mark.fake_cuda
def test_the_notebooks_gpu_branch_finds_and_fixes_every_planted_mistake(run_on_fake_cuda, check_common):
    """The notebook's real-GPU branch on CI's fake CUDA machine (2 GPUs; one timed step, three traced, whose
    median ignores one slow step of the host: with one traced step the straggler once went unseen after the
    data-loading fix; the GPU model's longer sequence costs it more than the emulated run): seed 0
    deals what shows on GPUs (not the logged accuracy nor the per-tensor all-reduces) at the GPU model's
    sequence, whose memory is sized for a cap on the caching allocator's *reserved* segments. The job as
    handed runs out with CUDA's message, the measurements name every planted mistake, the check passes, and
    the fixed job is faster than as it first ran and within the check's 1.2x of the clean one."""
    rec, text = run_on_fake_cuda(LAB, gpus=2, steps=1)
    check_common(rec, LAB, torchrun=False, world_size=2)
    assert rec["machine"] == "gpu" and rec["where"] == "emulated, fake CUDA" and rec["emulated"] is False
    planted = draw(0, on_gpu=True).planted
    assert planted == ("oom_batch", "straggler", "data_loading")
    assert rec["oom_at_start"] and "raised OutOfMemoryError: CUDA out of memory. Tried to allocate" in text
    assert [r["mistake"] for r in rec["rows"]] == list(planted) and rec["found"] == sorted(planted)
    assert all(r["found"] and r["fixed"] for r in rec["rows"]) and "check passed" in text
    assert rec["after"] < rec["before"] and rec["after"] <= SLOWER_OK * rec["limit"]
    assert rec["peak_mib"]["fixed"] <= rec["peak_mib"]["memory"] == draw(0, on_gpu=True).memory_mib


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


FIT = ("def fit_memory(job, model, memory_mib, world_size)", "check_fit_memory(fit_memory")
FIT_MISTAKES = {
    "no headroom": ({"if need.peak <= 0.9 * memory_mib": "if need.peak <= memory_mib"}, "with no headroom"),
    "the smallest that fits": ({"range(share, 0, -1)": "range(1, share + 1)"}, "smallest micro-batch"),
    "keep_grads left out": (
        {'precision="fp32", keep_grads=m < share)\n': 'precision="fp32", keep_grads=False)\n'},
        "leaves out keep_grads",
    ),
    "the notebook's world size": (
        {"    share = job.global_batch // world_size": "    share = job.global_batch // p.world_size"},
        "world size of its own",
    ),
    "bytes against MiB": ({"memory_mib * 2**20:\n": "memory_mib:\n"}, "peak is in bytes"),
    "labkit's own answer": (
        {
            (
                "    share = job",
                'sharding next")',
            ): "    from labkit.course.experiments.capstone import _fit_memory\n\n"
            "    return _fit_memory(job, model, memory_mib, world_size)"
        },
        "capstone._fit_memory, labkit's own answer",
    ),
}
FIX = ("def fix(job, finding)", "check_fix(fix")
FIX_MISTAKES = {
    "starts again from the job as handed": (
        {"dataclasses.replace(job,": "dataclasses.replace(cap.job,"},
        "starts again from cap.job",
    ),
    "the evaluation moved to the next rank": (
        {'"straggler": {"eval_rank": None}': '"straggler": {"eval_rank": 1 - (job.eval_rank or 0)}'},
        "one rank still evaluates all of it",
    ),
    "every knob at once": (
        {"**knobs[finding.kind]": "**{k: v for d in knobs.values() for k, v in d.items()}"},
        "one fix per finding",
    ),
    "the metric dropped": ({'{"accuracy": "local"}': '{"accuracy": "none"}'}, "left accuracy='none'"),
    "a knob the evidence does not point to": (
        {'"data_loading": {"tokenize": "ahead"}': '"data_loading": {"lr": job.lr / 2}'},
        "which does not make what this finding measured (a large share of the step goes to loading data",
    ),
    "nothing changed": (
        {'"small_collectives": {"grad_sync": "ddp"}': '"small_collectives": {}'},
        "returned the job unchanged. The finding measured that one collective per gradient after backward",
    ),
    "labkit's own answer": (
        {("    knobs = {", "**knobs[finding.kind])"): "    return lab06.by_diagnosis(finding.kind).fixed(job)"},
        "MISTAKES[...].fixed, labkit's own answer",
    ),
}
CASES = [(FIT, FIT_MISTAKES, n) for n in FIT_MISTAKES] + [(FIX, FIX_MISTAKES, n) for n in FIX_MISTAKES]


@pytest.mark.parametrize("exercise,mistakes,name", CASES, ids=[name for *_, name in CASES])
def test_a_wrong_answer_fails_at_its_check_with_its_hint(mutations_run, exercise, mistakes, name):
    failed = mutations_run(LAB, *exercise, {k: edits for k, (edits, _) in mistakes.items()})
    cell, error = failed[name]
    assert exercise[1] in cell, f"{name}: failed before its check: {error[-800:]}"
    assert mistakes[name][1] in error, f"{name}: the hint does not name the mistake: {error[-1500:]}"


@pytest.mark.parametrize(
    "exercise,mistakes", [(FIT, FIT_MISTAKES), (FIX, FIX_MISTAKES)], ids=["fit_memory", "fix"]
)
def test_the_right_answer_passes_the_check(mutations_run, exercise, mistakes):
    failed = mutations_run(LAB, *exercise, {k: edits for k, (edits, _) in mistakes.items()})
    assert failed["the right answer"] == ("", ""), failed["the right answer"][1][-1500:]
