"""Lab 05, the unprofiled run: what its notebook takes from the course, as `lab05.<name>`.

The trace analysis and its diagnosis the notebook imports from labkit itself. Here: its checked parameters
(`Params`), the training jobs it profiles (clean, with a planted mistake, fixed) and the mistakes they can
plant, their step times, the checks that name a wrong answer, the verdict and the practice questions.
"""

from __future__ import annotations

from labkit.course import quiz
from labkit.course.experiments.unprofiled_run import (
    Params,
    clean_job,
    fixed_job,
    kinds_left_out,
    kinds_that_show,
    mystery_job,
    step_ms,
)
from labkit.course.experiments.unprofiled_run_checks import check_find_straggler, check_mystery_fix
from labkit.course.forecast import verdict
from labkit.course.training import MISTAKES, by_diagnosis
from labkit.course.training.loop import train_jobs
from labkit.course.training.step_time import step_spread_ms, versus_clean

__all__ = [
    "MISTAKES", "Params", "by_diagnosis", "check_find_straggler", "check_mystery_fix", "clean_job",
    "fixed_job", "kinds_left_out", "kinds_that_show", "mystery_job", "quiz", "step_ms", "step_spread_ms",
    "train_jobs", "verdict", "versus_clean",
]
