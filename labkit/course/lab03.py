"""Lab 03, communication left unoverlapped: what its notebook takes from the course, as `lab03.<name>`.

The trace analysis and the link model it teaches the notebook imports from labkit itself; the `OverlappedDDP`
a learner completes is `labkit.parallel.data`'s, wrapped with the grader's guards (`OverlappedDDPExercise`).
Here: its checked parameters (`Params`), the training steps its ranks run, the checks that name a wrong
answer, the figures' notes, the overlap forecast, the verdict and the practice questions (`quiz`).
"""

from __future__ import annotations

from labkit.course import quiz
from labkit.course.experiments.unoverlapped_comms import Params, summarize_steps, train_steps
from labkit.course.experiments.unoverlapped_comms_checks import (
    OverlappedDDPExercise,
    check_overlapped_ddp,
    check_overlapped_step,
    drive_hooks_shuffled,
)
from labkit.course.experiments.unoverlapped_comms_figures import bound_notes, fixed_cost_line, valley_note
from labkit.course.forecast import fp32_flops_per_s, overlap_forecast, verdict

__all__ = [
    "OverlappedDDPExercise", "Params", "bound_notes", "check_overlapped_ddp", "check_overlapped_step",
    "drive_hooks_shuffled", "fixed_cost_line", "fp32_flops_per_s", "overlap_forecast", "quiz",
    "summarize_steps", "train_steps", "valley_note", "verdict",
]
