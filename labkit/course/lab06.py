"""Lab 06, the capstone: what its notebook takes from the course, as `lab06.<name>`.

The memory estimate and the trace analysis the notebook imports from labkit itself. Here: its checked
parameters (`Params`), the job dealt by seed with its planted mistakes, its step times, the checks on the
learner's fixes, and the mock exam (`quiz`).
"""

from __future__ import annotations

from labkit.course import quiz
from labkit.course.experiments.capstone import DEALT, Params, draw, exam_secret, step_ms, train
from labkit.course.experiments.capstone_checks import check_capstone
from labkit.course.experiments.capstone_exercise_checks import check_fit_memory, check_fix
from labkit.course.training import MISTAKES, by_diagnosis
from labkit.course.training.step_time import versus_clean

__all__ = [
    "DEALT", "MISTAKES", "Params", "by_diagnosis", "check_capstone", "check_fit_memory", "check_fix",
    "draw", "exam_secret", "quiz", "step_ms", "train", "versus_clean",
]
