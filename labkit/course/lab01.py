"""Lab 01, the parallelism choice: what its notebook takes from the course, as `lab01.<name>`.

The planner, the layouts and the link and memory models it teaches the notebook imports from labkit itself.
Here: its checked parameters (`Params`), the drivers its ranks run (one layout's steps, the operator rates
the planner uses), the checks that name a wrong answer, one process's gradients to compare a layout with,
Narayanan et al. 2021's Table 1 on the simulated machine, the verdict and the practice questions (`quiz`).
"""

from __future__ import annotations

from labkit.course import quiz
from labkit.course.experiments.parallelism_choice import (
    Params,
    layout_steps,
    measure_rates,
    median_rates,
    summarize_layout,
)
from labkit.course.experiments.parallelism_choice_checks import (
    check_layout_choice,
    check_planner_pick,
    check_tp_comm,
)
from labkit.course.experiments.published_runs import TABLE_1, simulate, table
from labkit.course.forecast import verdict
from labkit.course.training.reference import reference_gradients

__all__ = [
    "TABLE_1", "Params", "check_layout_choice", "check_planner_pick", "check_tp_comm", "layout_steps",
    "measure_rates", "median_rates", "quiz", "reference_gradients", "simulate", "summarize_layout",
    "table", "verdict",
]
