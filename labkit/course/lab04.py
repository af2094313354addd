"""Lab 04, the imbalanced pipeline: what its notebook takes from the course, as `lab04.<name>`.

The layer profile, the split and the pipeline plan it teaches the notebook imports from labkit itself. Here:
its checked parameters (`Params`), a pipeline's plan and the steps its ranks run, the layer costs measured
on a rank, the checks that name a wrong answer, the verdict, the pipeline explorer (`widgets`) and the
practice questions (`quiz`).
"""

from __future__ import annotations

from labkit.course import quiz, widgets
from labkit.course.experiments.imbalanced_pipeline import (
    Params,
    PipelinePlan,
    layer_costs,
    pipeline_steps,
    summarize_pipeline,
)
from labkit.course.experiments.imbalanced_pipeline_checks import check_balance, check_pipeline
from labkit.course.forecast import verdict

__all__ = [
    "Params", "PipelinePlan", "check_balance", "check_pipeline", "layer_costs", "pipeline_steps", "quiz",
    "summarize_pipeline", "verdict", "widgets",
]
