"""Lab 05's driver: a data-parallel job with one of the course's mistakes planted, found from its traces.

The job is the course's one training job (`labkit.course.training`): `clean_job` is the lab's version of it
with nothing planted, `mystery_job` plants one mistake of `labkit.course.training.MISTAKES` by the knob the
table names, and `fixed_job` applies the fix a trace's diagnosis names (which removes the planted mistake only
when the diagnosis named that one). Every rank measures and traces them with
`labkit.course.training.loop.train_jobs`. `mystery_seed` draws the planted mistake from
`kinds_that_show(machine)`, which leaves the host sync out on every machine and the logged accuracy out on
GPUs: `kinds_left_out` says why, for the notebook to print.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from labkit.course.experiments.params import LabParams, gpt_param, param, simulable_cluster
from labkit.course.experiments.script import LabRecords, Meaning, Where, main
from labkit.course.training.job import TrainingJob
from labkit.course.training.loop import JobResult, train_jobs
from labkit.course.training.mistakes import MISTAKES, by_diagnosis
from labkit.course.training.step_time import step_ms, step_spread_ms, versus_clean
from labkit.machine.machine import Machine
from labkit.trace.diagnose import diagnose

__all__ = [
    "MYSTERY_KINDS",
    "SIMULATED_PER_TENSOR_RANKS",
    "Params",
    "clean_job",
    "fixed_job",
    "headline",
    "kinds_left_out",
    "kinds_that_show",
    "mystery_job",
    "run_name",
    "step_ms",
]

# The mistakes mystery_seed draws from, in this order (a seed keeps its mistake).
MYSTERY_KINDS = ("straggler", "data_loading", "per_tensor_allreduce", "sync_logging", "host_sync")
# The fewest ranks of a simulated machine on which fixing per-tensor all-reduces takes the lab's step to at
# most 0.8x (the course's bar for a lesson that shows). Measured on simulated DGX H100 ranks at the lab's
# defaults, before -> after ms: 2 ranks 2.13 -> 2.63, 4: 2.51 -> 2.63, 6: 3.10 -> 2.63 (x0.85),
# 8: 3.68 -> 2.63 (x0.71).
SIMULATED_PER_TENSOR_RANKS = 8


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 05's parameters."""

    cluster: str = simulable_cluster()
    world_size: int = param(2, "data-parallel ranks (a straggler needs two)", minimum=2)
    n_layers: int = gpt_param("n_layers", 2)
    d_model: int = gpt_param("d_model", 64)
    vocab_size: int = gpt_param("vocab_size", 2048, "the logits are batch x seq x vocab")
    seq_len: int = gpt_param("seq_len", 64)
    micro_batch: int = param(8, "sequences per rank and step", minimum=1)
    mystery_seed: int = param(3, "picks which mistake is planted in the job", minimum=0)
    steps: int = param(3, "timed steps per job (after one warm-up step)", minimum=1)
    trace_steps: int = param(3, "profiled steps per job (after one profiled warm-up step)", minimum=1)
    trace_dir: str = param("traces_05", "the folder of the jobs' traces (replaced on each run)")

    GPT_FIXED = {"n_heads": 4}
    LAB = "05_unprofiled_run"
    NOTEBOOK_SIMULATED = True  # its exercise reads made-up breakdowns; the jobs and their traces run there
    RANKS_WHY = (
        "a straggler and the all-reduces need two ranks or more: every GPU of the node (one GPU: 2 emulated "
        "ranks)"
    )
    TEST = {
        "cluster": "cpu"
    }  # 3 timed steps: the median of 2 was one slow step of the host away from failing
    SMOKE = {"steps": 1, "trace_steps": 2}

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # any count of 2 or more: each rank takes micro_batch sequences (the global batch is their sum), and
        # its forecast shows the mistakes it draws on GPUs on 2 ranks and on 8 (tests/course/test_forecast.py)
        return gpus if gpus >= 2 else None

    def check(self) -> None:
        self.check_multiple("d_model", 4, "the lab's GPT has 4 attention heads")



def kinds_left_out(
    machine: Machine | None = None,
    *,
    on_gpu: bool = False,
    simulated: bool = False,
    world_size: int | None = None,
) -> dict[str, str]:
    """The mistakes of `MYSTERY_KINDS` whose cost does not show in this lab's measurement on `machine`, each
    with why, in a sentence a notebook prints; `kinds_that_show` is the rest.

    Never the host sync: on the emulated cluster compute is synchronous, so it costs nothing; on a GPU it
    costs what it stops from overlapping the device (host work after it that would otherwise run while the
    GPU computes), and in this job the `.item()` is the step's last device wait (`Trainer.update`) while
    `train_jobs` times every step alone, from a barrier to a synchronize, so nothing follows it.

    Where the lesson is judged by the course's targets (`Machine.judged_by_verdict`: GPUs, real, CI's fake
    ones or simulated), the mistakes the course's forecast shows there, so not the logged accuracy: at this
    lab's sizes a GPU's step is launch-bound (about 1.2 ms of host dispatch on a DGX H100) and all-gathering
    4 MiB of logits over NVLink takes some 15 us, so the fix moves nothing
    (`labkit.course.forecast.job_forecast`: after/before 1.01 on 2 ranks, 0.95 on 8; the other three
    0.40-0.77, tests/course/test_forecast.py). Over the emulated link the same all-gather is most of the step.

    Where a rank's time does not count host Python (`Machine.times_host_python`: a simulated machine), not the
    data loading, whose tokenizer is host Python. Where torch DDP cannot run (`Machine.torch_ddp`: a simulated
    machine), the per-tensor all-reduces only from `SIMULATED_PER_TENSOR_RANKS` ranks: the fix's buckets run
    in labkit's Python `OverlappedDDP` there (torch DDP's C++ reducer refuses tensors without storage), whose
    copies into and out of each bucket cost two host dispatches per gradient, which torch DDP's views into its
    buckets do not; on fewer ranks the 29 small all-reduces cost less than that
    (tests/course/experiments/test_unprofiled_run.py measures it).

    `machine`: where the lab runs, which answers all of that. Without it, a machine on paper (the forecasts'
    tests, a script's `Where`): `on_gpu`, a GPU node; `simulated`, a simulated one of `world_size` ranks."""
    if machine is not None:
        by_forecast, host_python = machine.judged_by_verdict, machine.times_host_python
        torch_ddp, ranks = machine.torch_ddp, machine.ranks
    else:
        by_forecast, host_python = on_gpu or simulated, not simulated
        torch_ddp, ranks = not simulated, world_size
    if not torch_ddp and ranks is None:
        raise ValueError("kinds_left_out(simulated=True) needs world_size: what shows there depends on it")
    out = {
        "host_sync": "on the emulated cluster compute is synchronous, and in this job's timed steps the "
        ".item() is the last wait before the step's own synchronize, so on a GPU too nothing follows it that "
        "it could stop from overlapping (section 7)"
    }
    if by_forecast:
        out["sync_logging"] = (
            "on GPUs at these sizes the step is launch-bound and all-gathering the logits over NVLink takes "
            "microseconds (labkit.course.forecast.job_forecast: the fix would move nothing)"
        )
    if not host_python:
        out["data_loading"] = "its tokenizer is host Python, which this machine's clock does not time"
    if not torch_ddp and ranks < SIMULATED_PER_TENSOR_RANKS:
        out["per_tensor_allreduce"] = (
            f"on fewer than {SIMULATED_PER_TENSOR_RANKS} ranks here the fix's buckets run in labkit's Python "
            "OverlappedDDP (torch DDP needs storage), whose bucket copies cost more host dispatches than the "
            f"small all-reduces of a few ranks save (world_size = {SIMULATED_PER_TENSOR_RANKS} shows it)"
        )
    return out


def kinds_that_show(
    machine: Machine | None = None,
    *,
    on_gpu: bool = False,
    simulated: bool = False,
    world_size: int | None = None,
) -> list[str]:
    """The mistakes whose cost shows in this lab's measurement on `machine` (or on paper: see
    `kinds_left_out`, which says why each other one does not), in `MYSTERY_KINDS`' order."""
    left_out = kinds_left_out(machine, on_gpu=on_gpu, simulated=simulated, world_size=world_size)
    return [k for k in MYSTERY_KINDS if k not in left_out]


def clean_job(micro_batch: int, world_size: int) -> TrainingJob:
    """The lab's job with nothing planted: SGD, DDP with 0.25 MiB buckets, no evaluation, no logged metric."""
    return TrainingJob(
        global_batch=micro_batch * world_size,
        micro_batch=micro_batch,
        optimizer="sgd",
        lr=0.05,
        bucket_cap_mb=0.25,
        accuracy="none",
    )


def mystery_job(clean: TrainingJob, kind: str, world_size: int, *, straggler_rank: int = 1) -> TrainingJob:
    """`clean` with the mistake `kind` planted (a straggler on `straggler_rank`)."""
    if kind not in MYSTERY_KINDS:
        raise ValueError(f"kind={kind!r} is not one of lab 05's mistakes: {', '.join(MYSTERY_KINDS)}")
    if not 0 <= straggler_rank < world_size:
        raise ValueError(f"straggler_rank={straggler_rank} must be a rank of the job, 0..{world_size - 1}")
    job = MISTAKES[kind].plant(clean, world_size, random.Random(0))
    return dataclasses.replace(job, eval_rank=straggler_rank) if kind == "straggler" else job


def fixed_job(job: TrainingJob, diagnosed: str) -> TrainingJob:
    """`job` with the fix the diagnosis `diagnosed` names (unchanged for "none" or a mistake it does not
    plant)."""
    mistake = by_diagnosis(diagnosed)
    return mistake.fixed(job) if mistake is not None and mistake.planted_in(job) else job


def run_name(job: TrainingJob, clean: TrainingJob) -> str:
    """A folder name: the mistake a job plants (with the straggler's rank), or "clean"; "_fixed" once
    fixed."""
    planted = [m for m in MYSTERY_KINDS if MISTAKES[m].planted_in(job)]
    if not planted:
        return "clean" if job == clean else "fixed"
    return "_".join(f"{m}_rank{job.eval_rank}" if m == "straggler" else m for m in planted)


# ----------------------------------------------------------------- as a script
# (labkit.course.experiments.script)


def headline(w: Where, p: Params) -> LabRecords:
    """Lab 05's records: the job with a mistake planted by `mystery_seed`, the same job with the fix the
    trace's diagnosis (`labkit.trace.diagnose`) names, and the clean job, in one launch."""
    config = p.config()
    shows = kinds_that_show(on_gpu=w.on_gpu, simulated=w.simulated, world_size=w.world_size)
    planted = random.Random(p.mystery_seed).choice(shows)
    folder = Path(p.trace_dir).resolve()
    if w.rank() == 0:
        shutil.rmtree(
            folder, ignore_errors=True
        )  # this run's traces only (ranks write theirs inside the launch)
    clean = clean_job(p.micro_batch, w.world_size)
    mystery = mystery_job(clean, planted, w.world_size)

    def runs(jobs: list[TrainingJob], names: list[str]) -> list[list[JobResult]]:
        per_rank = w.launch(
            train_jobs,
            config,
            jobs,
            str(folder),
            names=names,
            steps=p.steps,
            trace_steps=p.trace_steps,
            timeout_s=p.timeout_s,
            deadline_s=p.timeout_s * 3,
        )
        return [[rank[i] for rank in per_rank] for i in range(len(jobs))]

    (first,) = runs([mystery], ["mystery"])
    found = diagnose(Path(first[0].traces))
    fixed = fixed_job(mystery, found.kind)
    before, after, limit = runs([mystery, fixed, clean], ["before", "after", "clean"])
    return LabRecords(
        step_ms(before),
        step_ms(after),
        step_ms(limit),
        "ms",
        Meaning(
            before="data-parallel step time with a planted mistake (slowest rank's median)",
            after="step time after the fix that the trace's diagnosis pointed to",
            limit="the same job with nothing planted, measured in the same launch: a reference, not a bound",
        ),
        "step time of a job with a hidden mistake, before and after the fix the trace named",
        {
            "planted": planted,
            "diagnosed": found.kind,
            "evidence": found.evidence,
            "fix": by_diagnosis(found.kind).fix if by_diagnosis(found.kind) else "nothing to fix",
            "fixed": MISTAKES[planted].diagnosed_as == found.kind,
            "traces": first[0].traces,
            "clean_spread_ms": (spread := step_spread_ms(after, limit)),
            "versus_clean": versus_clean(step_ms(after), step_ms(limit), spread, w.label),
        },
    )


if __name__ == "__main__":
    main(__spec__.name)
