"""The one table of the course's mistakes, each a wrong value of one `TrainingJob` knob.

For every mistake: the lab that teaches it, the knob that plants it and its value once fixed, what
`labkit.trace.diagnose` calls it when a trace shows it, the fix in words and what the measurement shows. Lab
05 plants one at a time and fixes what the trace names; the capstone deals two or three and checks each fix
against this table; the course checks read their hints from it.

The mistakes, each seen in real jobs:

* "oom_batch" (lab 02): the micro-batch is the rank's whole share of the global batch, which does not fit; the
  fix keeps the global batch (smaller micro-batches, gradient accumulation under `no_sync`);
* "per_tensor_allreduce" (lab 03): every gradient all-reduced on its own after backward; DDP's buckets
  all-reduce during backward instead (Li et al. 2020, section 3.2.3);
* "straggler" (lab 05): one rank evaluates the whole held-out batch every step while the others wait for it at
  the next all-reduce; shared out, each rank evaluates its part;
* "data_loading" (lab 05): a slow tokenizer runs in the training process as samples are fetched; tokenized
  once before training instead (or in DataLoader workers);
* "sync_logging" (lab 05): every rank's logits all-gathered, blocking, between forward and backward to log a
  global accuracy; a local metric, all-reduced asynchronously and waited for at the end of the step, instead;
* "host_sync" (lab 05): `loss.item()` every step, which on a GPU drains the launch queue; it costs the host
  work after it that would otherwise overlap the device. On the emulated cluster compute is synchronous, so it
  costs nothing there (and `diagnose` rightly finds nothing); in lab 05's timed steps nothing follows it, so
  lab 05 does not draw it (`unprofiled_run.kinds_that_show`); `diagnose` still names it in a GPU trace.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from labkit.course.training.job import TrainingJob

__all__ = ["MISTAKES", "Mistake", "by_diagnosis", "held_out_samples", "planted_by_knobs"]

_SHARE = "the rank's whole share of the global batch"  # the oom_batch mistake's micro-batch


@dataclass(frozen=True)
class Mistake:
    """One of the course's mistakes (see the module docstring)."""

    name: str
    lab: str
    knob: str  # the TrainingJob field that plants it
    wrong: Any  # its value with the mistake in (a description where it depends on the job)
    right: Any  # its value once fixed (a description where it depends on the memory)
    diagnosed_as: str | None  # labkit.trace.diagnose's kind for it; None: an OOM shows it, not a trace
    fix: str  # the fix, in words
    shows: str  # what the measurement shows

    @property
    def by_knob(self) -> bool:
        """Can a job's knobs alone tell whether it is planted (not the OOM: only a measurement tells)?"""
        return self.name != "oom_batch"

    def planted_in(self, job: TrainingJob) -> bool:
        """Does `job`'s knob still plant it? (Never for oom_batch: see `by_knob`.)"""
        if self.name == "straggler":
            return job.eval_rank is not None and job.eval_samples > 0
        return self.by_knob and getattr(job, self.knob) == self.wrong

    def plant(self, job: TrainingJob, world_size: int, rng: random.Random) -> TrainingJob:
        """`job` with this mistake planted (the straggler on a rank `rng` picks; a job without evaluation
        gets the held-out batch first, `held_out_samples`)."""
        if self.name == "oom_batch":
            return dataclasses.replace(job, micro_batch=job.global_batch // world_size)
        if self.name == "straggler":
            samples = job.eval_samples or held_out_samples(job, world_size)
            return dataclasses.replace(job, eval_rank=rng.randrange(world_size), eval_samples=samples)
        return dataclasses.replace(job, **{self.knob: self.wrong})

    def fixed(self, job: TrainingJob) -> TrainingJob:
        """`job` with this mistake's knob set right (oom_batch has no single right value: ValueError)."""
        if not self.by_knob:
            raise ValueError(f"{self.name}: {self.fix}; the micro-batch that fits depends on the memory")
        return dataclasses.replace(job, **{self.knob: self.right})


_TABLE = (
    Mistake(
        name="oom_batch",
        lab="02_oom_batch",
        knob="micro_batch",
        wrong=_SHARE,
        right="the largest micro-batch that fits",
        diagnosed_as=None,
        fix="keep global_batch; take a smaller micro_batch (gradient accumulation makes up the rest)",
        shows="the job runs out of memory in its first step",
    ),
    Mistake(
        name="per_tensor_allreduce",
        lab="03_unoverlapped_comms",
        knob="grad_sync",
        wrong="per_tensor",
        right="ddp",
        diagnosed_as="small_collectives",
        fix='grad_sync="ddp": DDP all-reduces buckets during backward',
        shows="one collective per gradient after backward, with nothing computed beside them",
    ),
    Mistake(
        name="straggler",
        lab="05_unprofiled_run",
        knob="eval_rank",
        wrong="a rank",
        right=None,
        diagnosed_as="straggler",
        fix="eval_rank=None: every rank evaluates its share of the held-out batch",
        shows="one rank computes far more than the others, which wait for it",
    ),
    Mistake(
        name="data_loading",
        lab="05_unprofiled_run",
        knob="tokenize",
        wrong="in_loader",
        right="ahead",
        diagnosed_as="data_loading",
        fix='tokenize="ahead": tokenize once, before training (or in DataLoader workers)',
        shows="a large share of the step goes to loading data in the training process",
    ),
    Mistake(
        name="sync_logging",
        lab="05_unprofiled_run",
        knob="accuracy",
        wrong="gathered",
        right="local",
        diagnosed_as="sync_collective",
        fix='accuracy="local": a local metric, all-reduced asynchronously, waited for at the end',
        shows="a blocking collective between forward and backward, the ranks waiting in it",
    ),
    Mistake(
        name="host_sync",
        lab="05_unprofiled_run",
        knob="loss_readout",
        wrong="every_step",
        right="deferred",
        diagnosed_as="host_sync",
        fix='loss_readout="deferred": keep the loss on the device; read it every N steps',
        shows="the host waits for the device every step (.item()), on GPUs; it costs the host work after it",
    ),
)
MISTAKES: dict[str, Mistake] = {m.name: m for m in _TABLE}


def held_out_samples(job: TrainingJob, world_size: int) -> int:
    """The held-out batch a job evaluates every step: 4x a rank's share of the global batch, so that one rank
    evaluating all of it (forward only, about 4/3 of a training step's work) computes over twice what the
    others do: `diagnose` names a straggler from 1.5x (3x measured 1.58-1.77x over six launches, too near)."""
    return 4 * (job.global_batch // world_size)


def by_diagnosis(kind: str) -> Mistake | None:
    """The mistake `labkit.trace.diagnose` calls `kind` (None for "none" and kinds no knob plants)."""
    return next((m for m in MISTAKES.values() if m.diagnosed_as == kind), None)


def planted_by_knobs(job: TrainingJob) -> set[str]:
    """The mistakes `job`'s knobs still plant (all but the OOM, which only a measurement can tell)."""
    return {m.name for m in MISTAKES.values() if m.planted_in(job)}
