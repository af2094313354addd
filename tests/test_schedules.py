"""Ideal schedules run against their dependencies: the simulated bubble is the formula's, 1F1B holds p - rank
micro-batches where GPipe holds m, interleaving shrinks the bubble by v; and the pipeline explorer draws them."""

from __future__ import annotations

import matplotlib
import pytest

from labkit.pipeline import bubble_fraction, in_flight
from labkit.schedules import rank_order, simulate
from labkit.widgets import pipeline_explorer, pipeline_figure

matplotlib.use("Agg")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_have_the_formulas_bubble_and_memory(schedule):
    for p in (2, 3, 4, 6):
        for m in (p, p + 1, 2 * p, 3 * p + 1):
            sim = simulate(schedule, p, m)
            assert sim.bubble == pytest.approx(bubble_fraction(p, m, schedule))
            assert sim.step == pytest.approx(3 * (m + p - 1))
            assert sim.in_flight == [in_flight(schedule, p, m, r) for r in range(p)]
            for spans in sim.spans:  # a rank runs one thing at a time, every action once
                assert len(spans) == 2 * m
                assert all(a[4] <= b[3] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_interleaving_divides_the_bubble_by_v():
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4)):
        sim = simulate("interleaved_1f1b", p, m, v)
        assert sim.bubble == pytest.approx(bubble_fraction(p, m, "interleaved_1f1b", v))
        assert sim.bubble < simulate("1f1b", p, m).bubble
        assert sorted(k for k, *_ in rank_order("interleaved_1f1b", p, m, 0, v)).count("F") == m * v
    with pytest.raises(ValueError, match="not a multiple of p=4"):
        simulate("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="schedule"):
        simulate("zigzag", 4, 8)


def test_the_explorer_draws_and_reacts():
    import matplotlib.pyplot as plt

    fig = pipeline_figure(4, 8, "1f1b")
    assert "bubble 27.3% (formula 27.3%)" in fig.axes[0].get_title()
    plt.close(fig)
    box = pipeline_explorer(widgets=True)
    (_, m), (schedule, _) = box.children[0].children, box.children[1].children
    schedule.value = "interleaved_1f1b"
    m.value = 6  # not a multiple of p = 4: the explorer says why instead of drawing
    assert "not a multiple" in box.children[2].value
    m.value = 8
    assert box.children[2].value == ""
    plt.close("all")
