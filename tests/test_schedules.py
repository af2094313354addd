"""labkit.schedules: ideal schedules run against their dependencies: the simulated bubble is the formula's
(labkit.pipeline_plan), 1F1B holds p - rank micro-batches where GPipe holds m, interleaving shrinks the
bubble by v. The pipeline explorer that draws them: tests/course/test_widgets.py."""

from __future__ import annotations

import itertools

import pytest

from labkit.pipeline_plan import bubble_fraction, in_flight
from labkit.schedules import rank_order, simulate


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
                assert all(a[4] <= b[3] + 1e-9 for a, b in itertools.pairwise(spans))


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


def test_interleaving_holds_more_activations_on_the_first_ranks():
    """Lab 04, section 8: at p=4, m=8, v=2 rank 0 holds 5.5 micro-batches' worth of its layers' activations
    (each chunk of a micro-batch is 1/v of them) against 4 under 1F1B. It follows from the schedule: rank r
    runs (p - r - 1) x 2 + (v - 1) x p warm-up forwards (Megatron-LM's
    `forward_backward_pipelining_with_interleaving`; torch's `ScheduleInterleaved1F1B`, `_get_warmup_ops`) and
    one more forward before its first backward, so it peaks at p + (p - 1) / v - 2r / v. On rank 0 that is
    p x (1 + (p - 1) / (p v)): Megatron-LM's `interleaved_schedule_memory_penalty`
    (megatron/training/theoretical_memory_usage.py) on 1F1B's p micro-batches."""
    assert simulate("interleaved_1f1b", 4, 8, 2).in_flight[0] == 5.5
    assert simulate("1f1b", 4, 8).in_flight[0] == 4
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (8, 16, 2)):
        sim = simulate("interleaved_1f1b", p, m, v)
        assert sim.in_flight == pytest.approx([(2 * (p - r - 1) + (v - 1) * p + 1) / v for r in range(p)])
        assert sim.in_flight[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
        for r in range(p):  # the peak is the forwards the rank runs before its first backward
            kinds = [kind for kind, *_ in rank_order("interleaved_1f1b", p, m, r, v)]
            assert sim.in_flight[r] == pytest.approx(kinds.index("B") / v)
            assert sim.in_flight[r] > simulate("1f1b", p, m).in_flight[r]
