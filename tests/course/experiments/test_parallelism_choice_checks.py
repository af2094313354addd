"""labkit.course.experiments.parallelism_choice_checks (lab 01's checks): the layout choice's check names each
mistake (the two wrong answers the notebook's mutation tests do not run: they need no kernel); the end-to-end
check, `check_planner_pick`, passes a pick near the fastest layout and names each way one can fail."""

from __future__ import annotations

import pytest

from labkit import Cluster
from labkit.course.experiments.parallelism_choice_checks import check_layout_choice, check_planner_pick
from labkit.models import GPTConfig
from labkit.planner import Rates, plan

CONFIG = GPTConfig(n_layers=8, d_model=128, n_heads=8, vocab_size=1024, seq_len=64)
RATES = Rates(50e9, 5e-9, "fixed for the test")


def test_the_layout_choice_check_names_each_mistake():
    # The two wrong answers the notebook's mutation tests do not run (they need no kernel): the same check.
    cluster = Cluster.emulated(nodes=2, gpus_per_node=4, memory_gib=28 / 1024)
    p = plan(
        CONFIG,
        cluster,
        32,
        precision="fp32",
        rates=RATES,
        micro_batch_sizes=(4, 8),
        zero_stages=(0,),
        checkpointing=(False,),
    )
    best = p.best
    reason = f"{best.layout}: {best.predicted_ms:.1f} ms, {best.memory.peak / 2**20:.1f} MiB per GPU"
    assert check_layout_choice((best.dp, best.tp, best.pp), reason, p) is best
    with pytest.raises(AssertionError, match="the product must be 8"):
        check_layout_choice((2, 2, 1), reason, p)
    with pytest.raises(AssertionError, match="quote the planner's predicted step"):
        check_layout_choice((best.dp, best.tp, best.pp), "pipelines across the nodes are best", p)
    with pytest.raises(AssertionError, match="quote the planner's memory per GPU"):
        check_layout_choice((best.dp, best.tp, best.pp), f"{best.predicted_ms:.1f} ms", p)
    with pytest.raises(AssertionError, match="a tuple of three whole numbers"):
        check_layout_choice([2, 1, 4], reason, p)


MEASURED = {
    "(dp=8, tp=1, pp=1)": 50.0,
    "(dp=2, tp=4, pp=1)": 40.0,
    "(dp=1, tp=4, pp=2)": 43.0,
    "(tp=8)": 120.0,
}


def test_the_end_to_end_check_passes_a_pick_near_the_fastest():
    assert check_planner_pick(MEASURED, "(dp=1, tp=4, pp=2)", "(tp=8)", 0.8) == pytest.approx(43 / 40)


@pytest.mark.parametrize(
    "pick,rho,measured,message",
    [
        (
            "(dp=8, tp=1, pp=1)",
            0.9,
            MEASURED,
            r"is 25% slower than the fastest layout measured, \(dp=2, tp=4",
        ),
        (
            "(dp=2, tp=4, pp=1)",
            0.79,
            MEASURED,
            r"rank the layouts differently \(Spearman 0.79, at least 0.8\)",
        ),
        (
            "(dp=2, tp=4, pp=1)",
            1.0,
            {**MEASURED, "(tp=8)": 40.0},
            "is not faster than tensor parallelism across",
        ),
    ],
)
def test_the_end_to_end_check_names_each_failure(pick, rho, measured, message):
    with pytest.raises(AssertionError, match=message):
        check_planner_pick(measured, pick, "(tp=8)", rho)
    with pytest.raises(ValueError, match="was not measured"):
        check_planner_pick(MEASURED, "(dp=4, tp=2, pp=1)", "(tp=8)", rho)
