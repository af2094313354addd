"""Lab 02, the batch that runs out of memory: what its notebook takes from the course, as `lab02.<name>`.

The memory estimate, its parts and the batch finder it teaches the notebook imports from labkit itself. Here:
its checked parameters (`Params`), the data-parallel job its ranks run and the largest micro-batch that fits,
the checks that name a wrong answer, one process's gradients, the precision comparison, the fragmentation
demonstration with the allocator's fixes, the memory calculator (`widgets`) and the practice questions.
"""

from __future__ import annotations

from labkit.course import quiz, widgets
from labkit.course.experiments.fragmentation import ALLOCATOR_FIXES, fragment
from labkit.course.experiments.oom_batch import Params, dp_train, max_micro_batch
from labkit.course.experiments.oom_batch_checks import check_accumulation, check_memory_fix
from labkit.course.experiments.precision import compare_precisions, forced_overflow
from labkit.course.training.reference import reference_gradients

__all__ = [
    "ALLOCATOR_FIXES", "Params", "check_accumulation", "check_memory_fix", "compare_precisions",
    "dp_train", "forced_overflow", "fragment", "max_micro_batch", "quiz", "reference_gradients", "widgets",
]
