"""Lab 03's figures say where a run contradicts the bounds and the valley they draw (issue 44's numbers)."""

from __future__ import annotations

from labkit.course.experiments.unoverlapped_comms_figures import bound_notes, fixed_cost_line, valley_note


def test_the_busy_run_of_the_issue_is_said_to_cross_its_bounds():
    # a loaded 2-core machine: limit 155 ms under compute alone's 163, torch DDP 158 faster than compute alone
    notes = bound_notes({"compute": 163.0, "naive": 190.0, "overlapped": 160.0, "torch_ddp": 158.0}, 155.0)
    text = " ".join(notes)
    assert "torch DDP (158.0 ms) measured faster than compute alone (163.0 ms)" in text
    assert "overlapped (160.0 ms) measured faster than compute alone" in text
    assert "the limit (155.0 ms, from the overlapped step's own compute) is under compute alone" in text
    assert "read the limit as approximate on this run" in notes[-1]


def test_a_run_whose_bounds_hold_gets_no_note():
    # the simulated node: compute alone under the limit is right (the limit is the overlapped step's own
    # compute, bucket copies included); every synchronised step at or above it
    assert (
        bound_notes({"compute": 18.3, "naive": 24.7, "overlapped": 23.7, "comm_overlapped": 9.5}, 23.6) == []
    )
    assert "under the limit" in bound_notes({"compute": 10.0, "overlapped": 11.0}, 12.0)[0]


def test_the_sweep_of_the_issue_has_no_left_side_and_a_real_one_has_a_valley():
    flat_left = [
        {"bucket_cap_mb": 1e-6, "step_ms": 170.5},
        {"bucket_cap_mb": 0.125, "step_ms": 169.8},
        {"bucket_cap_mb": 0.5, "step_ms": 170.2},
        {"bucket_cap_mb": 5.1, "step_ms": 190.0},
    ]
    note = valley_note(flat_left)
    assert note.startswith("no valley on this run (fastest at bucket_cap_mb=0.125 (169.8 ms))")
    assert "no left side" in note and "no right side" not in note
    valley = [
        {"bucket_cap_mb": 1e-6, "step_ms": 180.0},
        {"bucket_cap_mb": 0.5, "step_ms": 150.0},
        {"bucket_cap_mb": 5.1, "step_ms": 190.0},
    ]
    assert valley_note(valley).startswith("the valley shows: fastest at bucket_cap_mb=0.5 (150.0 ms)")
    assert "no valley" in valley_note(valley[1:])  # fastest at an end


def test_a_fit_that_falls_with_the_collectives_says_no_fixed_cost_shows():
    # the simulated run of the issue printed "≈ 9.8 ms + -0.00 ms per collective"
    assert "no fixed cost per collective shows" in fixed_cost_line(-0.001, 9.8, "simulated")
    assert "+ 0.05 ms per collective" in fixed_cost_line(0.05, 3.0, "emulated")
