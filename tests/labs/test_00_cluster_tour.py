"""Lab 00, the cluster tour: its notebook, its script under torchrun, and the wrong answers to its
exercise."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from labkit.cluster import GPU, Cluster
from labkit.course.forecast import bandwidth_forecast, lesson_shows
from labkit.gpu_links import FAKE_CUDA_SUFFIX
from labkit.links import Link
from labkit.machine.machine import Machine

LAB = "00_cluster_tour"
NODE = Cluster.resolve("sim:dgx-h100", 8)


def expect(rec: dict[str, Any], check_common, *, torchrun: bool = False, world_size: int = 2) -> None:
    """Lab 00's records, wherever they were measured."""
    check_common(rec, LAB, torchrun=torchrun, world_size=world_size)
    sizes = [int(k * 1024) for k in rec["params"]["sizes_kib"]]
    assert [r["size_bytes"] for r in rec["sweep"]] == sizes and all(r["time_ms"] > 0 for r in rec["sweep"])
    if rec["emulated"]:  # the virtual clock honours the latency term: bandwidth grows with the message
        assert 0 < rec["before"] < rec["after"] <= rec["limit"] * 1.1
    if torchrun:  # gloo over loopback has no published link figure
        assert rec["limit"] is None and "no published link figure" in rec["meaning"]["limit"]
    else:  # the sweep on a simulated DGX H100 node: the forecast of the GPU sizes on paper, exactly
        node = rec["simulated_node"]
        paper = bandwidth_forecast(node["sizes"], 8, NODE.intra_node)
        assert node["label"] == "simulated H100-SXM5-80GB" and node["limit"] == paper.limit == 450
        assert (node["before"], node["after"]) == pytest.approx((paper.before, paper.after), rel=1e-6)


def test_the_solution_notebook_shows_the_lesson(run_solution, check_common):
    expect(run_solution(LAB), check_common)


def test_on_a_simulated_node_the_notebook_sweeps_the_gpu_sizes_as_forecast(run_solution, check_common):
    """cluster="sim:dgx-h100": the sweep at the GPU defaults (4 KiB to 1 GiB) on 8 simulated H100s, the
    all-reduce exercise checked on the emulated cluster; before / after / limit as forecast on paper."""
    rec = run_solution(LAB, cluster="sim:dgx-h100", world_size=8, sizes_kib=None)
    expect(rec, check_common, world_size=8)
    sizes = [r["size_bytes"] for r in rec["sweep"]]
    assert sizes == [4096 * 4**i for i in range(10)]
    paper = bandwidth_forecast(sizes, 8, NODE.intra_node)
    assert (rec["before"], rec["after"], rec["limit"]) == pytest.approx(
        (paper.before, paper.after, paper.limit), rel=1e-6
    )


def test_the_script_runs_on_a_simulated_node(simulated_lab):
    rec = simulated_lab(LAB, 8)
    paper = bandwidth_forecast([r["size_bytes"] for r in rec["sweep"]], 8, NODE.intra_node)
    assert rec["where"] == "simulated H100-SXM5-80GB" and rec["emulated"]
    assert (rec["before"], rec["after"]) == pytest.approx((paper.before, paper.after), rel=1e-6)
    assert "the simulated link's β (NVLink 4 + NVSwitch)" in rec["meaning"]["limit"]


@pytest.mark.fake_cuda
def test_on_fake_cuda_the_bus_bandwidth_approaches_the_link_as_the_course_verdict_says(run_on_fake_cuda):
    """The notebook's GPU branch on CI's fake CUDA machine (2 fake H100s, links scaled to this CPU, collectives
    on the virtual clock): the sweep's largest message reaches the link's bandwidth within the course's
    targets (before/after <= 0.8, limit/after <= 1.25), the verdict says so next to the forecast on paper, and
    the measured points follow the α-β model the collectives run on (a real GPU's NCCL is not held to it)."""
    rec, text = run_on_fake_cuda(LAB, gpus=2, iters=5)
    assert rec["machine"] == "gpu" and rec["emulated"] is False and rec["where"] == "emulated, fake CUDA"
    assert lesson_shows(rec["before"], rec["after"], rec["limit"], targets="bandwidth"), rec
    assert "forecast: 00_cluster_tour on emulated, fake CUDA" in text
    assert "check passed: before/after = " in text and "measured vs model: within" in text


def test_the_sweep_is_held_to_the_alpha_beta_model_only_where_collectives_run_on_it():
    """The notebook checks its sweep against the α-β model where each collective takes the model's time (the
    virtual clock, a simulated node, CI's fake CUDA machine), not on a real node, whose NCCL reaches about 80 %
    of the line rate (more with NVLS), nor on the wall clock."""

    def node(name: str) -> Machine:
        return Machine(replace(NODE, kind="gpu", gpus=(GPU(0, name, 80.0), GPU(1, name, 80.0))), 2)

    link = Link(1.0, 10.0)
    assert Machine(Cluster.emulated(intra_node=link, inter_node=link), 2).collectives_modelled
    assert not Machine(
        Cluster.emulated(intra_node=link, inter_node=link, clock="wall"), 2
    ).collectives_modelled
    assert Machine(NODE, 8).collectives_modelled and node(f"H100 {FAKE_CUDA_SUFFIX}").collectives_modelled
    assert not node("NVIDIA H100 80GB HBM3").collectives_modelled


def test_the_lab_notebook_is_its_solution_up_to_the_first_exercise(lab_matches_solution):
    lab_matches_solution(LAB)


@pytest.mark.parametrize("n", [2])  # one size: labs 01 and 04, whose layouts and stages differ, run both
def test_the_script_under_torchrun(torchrun_lab, check_common, n):
    proc, rec = torchrun_lab(LAB, n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("records in ") == 1  # rank 0 alone prints the records
    expect(rec, check_common, torchrun=True, world_size=n)


EXERCISE = ("def sum_over_ranks", "check_sum_over_ranks(results")
MISTAKES = {
    "all_reduce result assigned": ({"dist.all_reduce(t)": "t = dist.all_reduce(t)"}, "returns None"),
    "sum divided by world size": (
        {"dist.all_reduce(t)": "dist.all_reduce(t)\n    t /= dist.get_world_size()"},
        "do not divide",
    ),
    "no all_reduce": ({"dist.all_reduce(t)": "pass"}, "still holds its own value"),
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
