"""Lab 03, unoverlapped communication: its notebook, its script under torchrun, and the wrong answers to its
exercise (the gradient hook and the bucket flush of OverlappedDDP)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from labkit.course.experiments.unoverlapped_comms_checks import OverlapCheck

LAB = "03_unoverlapped_comms"


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 2) -> None:
    """Lab 03's records, wherever they were measured. On the emulated cluster's virtual clock the step is near
    its limit and, where the run leaves the lesson room (max(compute alone, communication alone) at most 0.8 of
    the naive step), the fix takes off at least half of what overlapping can take off: the balance of compute and
    links is this run's, which another CPU or a shared host moves (`check_overlapped_step`). The traces show the
    overlap whatever the balance."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    assert rec["unit"] == "ms" and rec["limit"] > 0
    assert rec["collectives_after"] < rec["collectives_before"] and rec["max_abs_diff"] < 1e-5
    if rec["emulated"]:
        floor = max(rec["compute_ms"], rec["comm_ms"])
        checked = OverlapCheck(rec["before"], rec["after"], rec["limit"], floor)
        if checked.shows():  # floor / before <= 0.8
            assert checked.won >= 0.5
        assert checked.to_limit <= 1.25
        assert rec["overlap_pct_before"] < 5 < 50 < rec["overlap_pct_after"]
    if "comm_fits_under_backward" in rec:  # the notebook says whether the bucketed communication fits under
        # backward (about 2/3 of compute: 4 of the 6 FLOP per parameter and token), so whether the limit
        # max(compute, comm) is also DDP's reachable T_fwd + max(T_bwd, T_comm) + T_opt; it measured 0.70 of
        # compute on one 2-core VM and under 2/3 on others, so the notebook says which, and the test that it is right
        fits = rec["comm_ms"] <= 2 / 3 * rec["compute_ms"]
        assert rec["comm_fits_under_backward"] == fits, (rec["comm_ms"], rec["compute_ms"])


def test_the_solution_notebook_shows_the_lesson(run_solution, check_common):
    expect(run_solution(LAB), check_common)


def test_the_script_on_a_simulated_dgx_h100_node_shows_the_lesson(simulated_lab):
    """Eight simulated H100s at the GPU sizes' width (d_model 2048, fp32) with 4 blocks of their 8: the buckets
    hide the all-reduces under backward, as the course's targets ask (after/before <= 0.8, after/limit <=
    1.25); nothing numeric is checked there (max_abs_diff None). A simulated operator costs its dispatch, not
    its size, so the blocks set the time: 8 took 54 s on the 2-core VM, 4 take 28 s, at the same after/before
    (0.77; compute and gradient bytes both halve); one process for the eight alike ranks (launch's alike),
    11 s."""
    rec = simulated_lab(LAB, 8, "--set", "n_layers", "4")
    assert rec["where"] == "simulated H100-SXM5-80GB" and rec["params"]["d_model"] == 2048
    assert rec["params"]["steps"] == 1  # SIMULATED_SIZES: a simulated step repeats exactly
    assert rec["after"] / rec["before"] <= 0.8 and rec["after"] / rec["limit"] <= 1.25
    assert rec["max_abs_diff"] is None and rec["collectives_after"] < rec["collectives_before"]


def test_labkit_run_on_a_simulated_node_says_where_it_ran_and_its_forecast_agrees_with_its_verdict(
    repo, labkit_env, tmp_path, read_printed
):
    """`labkit run --lab 03 --cluster sim:dgx-h100`, as a new user types it (issue 44), at its default two
    ranks: the exercise's parameters are checked against one process on the emulated cluster; the GPU-sized
    steps and traces run on the simulated node, where nothing numeric is compared and torch DDP (whose C++
    reducer needs storage) is left out. The report says it ran there, and the forecast and the verdict say
    the same (on 2 NVLink ranks the lesson does not show; the forecast names the whole node, where it does)."""
    cmd = [sys.executable, "-m", "labkit.course.cli", "run", "--lab", "03", "--cluster", "sim:dgx-h100", "--quiet"]
    cmd += ["-p", "sweep_caps_mb", "[25.0]"]  # one swept cap of the GPU sizes' four: the sweep is the script's
    cmd += ["-p", "n_layers", "4"]  # of the GPU sizes' 8: half the simulated operators, the same story
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path / "runs")],
        cwd=repo,
        env=labkit_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d.name != "latest"]
    report = json.loads((run_dir / "report.json").read_text())
    rec = report["labs"][0]["records"]
    assert rec["params"]["d_model"] == 2048 and rec["max_abs_diff"] is None and rec["torch_ddp_ms"] is None
    assert rec["after"] < rec["before"] and rec["overlap_pct_after"] > rec["overlap_pct_before"]
    md = (run_dir / "report.md").read_text()
    assert "Simulated cluster" in md and "Emulated cluster" not in md
    assert "| simulated H100-SXM5-80GB | passed |" in md
    printed = read_printed(run_dir / f"{LAB}.ipynb")  # the outputs, not the code that prints them
    forecast_shows = "): the lesson shows" in printed.split("on the whole node")[0]
    verdict_shows = "the lesson does not show on this machine" not in printed
    assert forecast_shows == verdict_shows, printed[-3000:]
    if not forecast_shows:  # the forecast then says where it shows: the node's 8 GPUs
        assert "on the whole node (-p world_size 8):" in printed and "the lesson shows" in printed
    assert "-0.00 ms per collective" not in printed
    assert "CPU ms per step" not in printed  # the simulator's own CPU time is no host's: not shown there


@pytest.mark.fake_cuda
def test_the_gpu_branch_on_fake_cuda_overlaps_and_prints_the_verdict_its_numbers_call_for(
    run_on_fake_cuda, check_verdict
):
    """The notebook's real-GPU branch on two fake H100s (labkit.machine.emulate.fake_cuda: collectives on the emulated
    backend and its virtual clock, links scaled to this CPU): torch DDP runs, the parameters are checked against
    one process, the buckets overlap and shorten the step, and the GPU branch prints the verdict its measured
    numbers call for (labkit.course.forecast.verdict). Three blocks, three timed steps, one swept bucket size
    and half the micro-batch: the fake's memory model (a Python dispatch mode) still costs every operator some
    50 us of compute on the rank's clock, which leaves communication a smaller share of the step than on the
    emulated cluster (at 12 sequences after/before measured 0.74-0.84 on the 2-core VM; at 6, 0.66-0.73 with
    after/limit 1.10)."""
    # three timed steps, so that the medians ignore one slow step (two measured after/limit 1.38 once, on a
    # VM noisy enough that lab 05's gallery missed its data-loading stall in the same run)
    rec, text = run_on_fake_cuda(LAB, n_layers=3, micro_batch=6, steps=3, sweep_caps_mb=[0.5])
    assert rec["machine"] == "gpu" and rec["where"] == "emulated, fake CUDA" and rec["emulated"] is False
    assert rec["max_abs_diff"] < 1e-5 and rec["torch_ddp_ms"] is not None
    assert rec["after"] < rec["before"] and rec["overlap_pct_after"] > rec["overlap_pct_before"], rec
    check_verdict(rec, text)


def test_the_lab_notebook_is_its_solution_up_to_the_first_exercise(lab_matches_solution):
    lab_matches_solution(LAB)


@pytest.mark.parametrize("n", [2])  # one size: labs 01 and 04, whose layouts and stages differ, run both
def test_the_script_under_torchrun(torchrun_lab, check_common, n):
    proc, rec = torchrun_lab(LAB, n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expect(rec, check_common, torchrun=True, world_size=n)


EXERCISE = ("class MyOverlappedDDP", "check_overlapped_ddp(drill")
MISTAKES = {
    "buckets flushed as they complete": (
        {
            "        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending "
            "== "
            "0:\n "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            "self.flush(self.buckets[self.next_bucket])\n "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            " "
            "self.next_bucket "
            "+= "
            "1": "        if bucket.pending == 0:\n            self.flush(bucket)\n            self.next_bucket += 1"
        },
        "in index order",
    ),
    "next bucket never advanced": ({"            self.next_bucket += 1\n": ""}, "flushed again"),
    "async_op forgotten": ({", async_op=True)": ")"}, "async_op=True"),
    "divided in the flush": (
        {
            "        self.after_launch(bucket, t0)": "        self.after_launch(bucket, t0)\n"
            "        bucket.work.wait()\n        bucket.buffer.div_(dist.get_world_size())"
        },
        "divided by the world size twice",
    ),
    "the base class called": (
        {
            "        bucket = self.bucket_of[id(param)]\n": "        super().on_grad_ready(param)\n        return\n"
        },
        "yours to write",
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
