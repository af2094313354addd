"""`train_jobs`: several training jobs on every rank, measured alike: their memory, their step, their traces.

Launch it with `labkit.launch` (every rank calls it). For each job, one after the other:

1. with `memory_mib`: the job alone inside that much device memory
(`labkit.machine.device_memory.memory_limit`: the
   emulated budget, or a GPU cap above the warm baseline), two optimizer steps: an OOM there is the job's OOM,
   and the peak of the second (Adam's states and DDP's buckets exist by then) is the job's memory. The job is
   then freed, so the next one is measured alone;
2. `warmup + steps` steps of every job, taking turns step by step (a slow moment of the machine hits them all
   alike), each after a barrier and timed on the rank's timer (`labkit.machine.timer.Span`);
3. `trace_steps` more under `labkit.trace.capture` (after one profiled warm-up step, so that the traced steps
   are in the steady state: a fast rank already waits for a straggler's previous step), one folder per job.

`same_core`: on the emulated cluster every rank shares one core (`labkit.machine.runtime.share_one_core`), so
that a slow core is not taken for a straggler, at twice the wall time. Each emulated rank first pages its heap
in (`labkit.machine.runtime.warm_heap`), so that a rank's first touch of fresh memory is not taken for one
either.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from labkit import validate
from labkit.course.training.job import TrainingJob, job_name
from labkit.course.training.trainer import Trainer
from labkit.machine import device_memory, runtime
from labkit.machine.timer import Span
from labkit.measured_memory import free_memory
from labkit.models import GPTConfig
from labkit.trace.capture import capture

__all__ = ["JobResult", "job_memory_mib", "train_jobs"]

_MIB = 2**20


@dataclass(frozen=True)
class JobResult:
    """What one rank measured of one job (ms on the rank's timer; MiB of device memory)."""

    job: TrainingJob
    rank: int
    steps_ms: list[float]  # each timed step after the warm-up
    step_ms: float  # their median
    loss: float  # of the last timed step
    traces: str  # the folder of this job's per-rank traces
    peak_mib: float | None = None  # the peak of a steady step inside memory_mib (None without it)


def job_memory_mib(
    job: TrainingJob, config: GPTConfig, memory_mib: float, process_group: dist.ProcessGroup | None = None
) -> float:
    """Two steps of `job` alone inside `memory_mib` of device memory; the second step's peak, in MiB.

    Raises `torch.OutOfMemoryError` when the job does not fit. Tokenized ahead: the tokenizer's time is not
    device memory, and sizing it would run a forward and backward of its own."""
    free_memory()  # what earlier jobs left in reference cycles, or cached on the GPU
    rank = dist.get_rank(process_group)
    with device_memory.memory_limit(int(memory_mib * _MIB), rank=rank):
        trainer = Trainer(
            dataclasses.replace(job, tokenize="ahead"), config, steps=2, process_group=process_group
        )
        trainer.step()  # creates Adam's states; DDP rebuilds its buckets in gradient order
        _, peak = device_memory.step_peak(trainer.step)
        del trainer
    free_memory()
    return peak.peak_bytes / _MIB


def train_jobs(
    config: GPTConfig,
    jobs: Sequence[TrainingJob],
    trace_dir: str,
    *,
    names: Sequence[str] | None = None,
    steps: int = 2,
    warmup: int = 1,
    trace_steps: int = 3,
    memory_mib: float | None = None,
    same_core: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> list[JobResult]:
    """Every rank: measure each of `jobs` (see the module docstring); this rank's `JobResult` per job.

    `names`: a folder name per job under `trace_dir` (default: its index and the knobs that differ from
    `TrainingJob()`; two jobs may be alike).
    """
    validate.positive_int("steps", steps, "train_jobs(config, jobs, dir, steps=2)")
    validate.non_negative_int("warmup", warmup, "train_jobs(config, jobs, dir, warmup=1)")
    validate.positive_int("trace_steps", trace_steps, "train_jobs(config, jobs, dir, trace_steps=3)")
    names = list(names) if names is not None else [f"{i}_{job_name(job)}" for i, job in enumerate(jobs)]
    if len(names) != len(jobs):
        raise ValueError(f"names has {len(names)} entries for {len(jobs)} jobs: one folder name per job")
    runtime.warm_heap()  # before the ranks share one core: each touches its own pages at once
    if same_core:
        runtime.share_one_core()
    rank = dist.get_rank(process_group)
    peaks = [job_memory_mib(job, config, memory_mib, process_group) if memory_mib else None for job in jobs]
    trainers = [
        Trainer(job, config, steps=warmup + steps + 1 + trace_steps, process_group=process_group)
        for job in jobs
    ]
    times: list[list[float]] = [[] for _ in jobs]
    losses = [None] * len(jobs)
    for _ in range(warmup + steps):
        for i, trainer in enumerate(trainers):
            dist.barrier(group=process_group)
            with Span() as span:
                losses[i] = trainer.step()
            times[i].append(span.ms)
    out = []
    for trainer, name, t, loss, peak in zip(trainers, names, times, losses, peaks):
        dist.barrier(group=process_group)
        path = capture(
            trainer.step, steps=trace_steps, warmup=1, path=Path(trace_dir) / name / "trace_rank{rank}.json"
        )
        measured = t[warmup:]
        out.append(
            JobResult(
                trainer.job,
                rank,
                measured,
                statistics.median(measured),
                runtime.value_of(loss),  # NaN on a simulated machine
                str(path.parent),
                peak,
            )
        )
    return out
