"""The course's one data-parallel training job, in which each of its mistakes is a knob.

* `job.py`: `TrainingJob`, the knobs a training script's config holds (batch, optimizer, precision, gradient
  sync, evaluation, tokenization, logging), validated;
* `mistakes.py`: `MISTAKES`, the one table of the course's mistakes: the knob that plants each, its fix, what
  `labkit.trace.diagnose` calls it, the hint;
* `reference.py`: the one data split (`rank_rows`) and the single-process reference every data-parallel
  step is checked against;
* `data.py`: a rank's samples, tokenized ahead or (the mistake) as they are fetched;
* `grad_sync.py`: how gradients are averaged: none, per tensor after backward (the mistake), labkit's
  `OverlappedDDP`, torch DDP (counted);
* `trainer.py`: `Trainer`, one rank's run of a job; `step()` is one optimizer step;
* `loop.py`: `train_jobs`, several jobs on every rank: their memory, timed steps taking turns, then traces.

Labs 02, 03, 05 and 06 train with it (`labkit.course.experiments`).
"""

from labkit.course.training.job import TrainingJob
from labkit.course.training.mistakes import MISTAKES, Mistake, by_diagnosis
from labkit.course.training.trainer import Trainer

__all__ = ["MISTAKES", "Mistake", "Trainer", "TrainingJob", "by_diagnosis"]
