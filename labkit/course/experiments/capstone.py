"""The capstone's driver: the course's one training job with two or three of its mistakes planted.

`draw(seed, machine)` deals a `Capstone`: a GPT, the job as handed over (a
`labkit.course.training.TrainingJob` with mistakes of `DEALT` planted by the knobs
`labkit.course.training.MISTAKES` names), chosen by the seed so that every learner, or every exam sitting,
gets a different job, and the memory of the job's (emulated) GPU, as the machine it runs on (a
`labkit.machine.machine.Machine`) shows them. `train(capstone, jobs, trace_dir)` measures jobs on every rank
(launch it with `labkit.launch`): each job's memory inside the GPU's memory, its step time, its traces
(`labkit.course.training.loop.train_jobs`). `headline` is the capstone solved by measurement alone, as a
script (on a simulated machine too: `--cluster sim:dgx-h100`)."""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from labkit.course.experiments.params import LabParams, param, simulable_cluster
from labkit.course.experiments.script import LabRecords, Meaning, Where, main
from labkit.course.experiments.unprofiled_run import MYSTERY_KINDS, kinds_that_show
from labkit.course.training.job import TrainingJob, job_name
from labkit.course.training.loop import JobResult, train_jobs
from labkit.course.training.mistakes import MISTAKES, by_diagnosis, held_out_samples
from labkit.course.training.step_time import step_ms, step_spread_ms, versus_clean
from labkit.errors import RankError
from labkit.machine.machine import Machine
from labkit.memory import estimate
from labkit.models import GPTConfig
from labkit.trace.diagnose import findings

__all__ = [
    "DEALT",
    "EXAM_SECRET_ENV",
    "GPU_MODEL",
    "MODEL",
    "SEGMENT_SLACK_MIB",
    "Capstone",
    "Params",
    "clean_job",
    "dealt",
    "draw",
    "exam_secret",
    "headline",
    "step_ms",
    "train",
]

# The mistakes a capstone is dealt from, in this order (a seed keeps its job). A host sync is left out: it
# costs nothing where compute is synchronous (the emulated cluster), and on a GPU nothing follows it in a
# timed step (`unprofiled_run.kinds_that_show`).
DEALT = ("oom_batch", "per_tensor_allreduce", "straggler", "data_loading", "sync_logging")
_MIB = 2**20
MODEL = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=2048, seq_len=64)
# On a GPU the memory cap limits what CUDA's caching allocator *reserves*, in segments of 2 and 20 MiB
# (c10/cuda/CUDACachingAllocator.cpp, kSmallBuffer and kLargeBuffer). Replayed through labkit's model of that
# allocator, the default model's clean job reserves 28 MiB against its 22 MiB (it would run out on a card) and
# the planted OOM only 30: no cap tells them apart. Four times the sequence, and some of a segment's slack on
# top of the memory, do (tests/course/experiments/test_capstone_gpu.py: against 71.4 MiB the clean job
# reserves 54, the whole batch in one micro-batch allocates 87, 17 and 16 MiB either side). The logged
# accuracy's gathered logits reserved 66 or 82 MiB in two replays (where the completion thread frees them
# decides), so on GPUs, where it is not dealt anyway, nothing is sized for it.
GPU_MODEL = dataclasses.replace(MODEL, seq_len=256)
SEGMENT_SLACK_MIB = 10  # half a large segment (kLargeBuffer, 20 MiB) that a step's blocks may leave free
# Exam mode: a file holding the instructor's secret, which `draw` mixes into the seed.
EXAM_SECRET_ENV = "LABKIT_EXAM_SECRET_FILE"


def exam_secret(environ: dict[str, str] | None = None) -> str | None:
    """The instructor's exam secret: the text of the file `$LABKIT_EXAM_SECRET_FILE` names (None: not set).

    With it, `draw` deals from the seed and the secret together, so the public seed alone no longer tells the
    planted mistakes (`draw(seed).planted`). The learner's kernel and `labkit grade` must read the same
    file."""
    env = os.environ if environ is None else environ
    path = env.get(EXAM_SECRET_ENV, "").strip()
    if not path:
        return None
    try:
        secret = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(
            f"{EXAM_SECRET_ENV}={path!r} cannot be read ({err.strerror}): point it at the instructor's "
            f"secret file, or unset it to deal from the seed alone"
        ) from err
    if not secret:
        raise ValueError(
            f"{EXAM_SECRET_ENV}={path!r} is empty: write the secret in it (any text, e.g. from "
            f"`python3 -c 'import secrets; print(secrets.token_hex(16))'`), or unset it"
        )
    return secret


def dealt(
    machine: Machine | None = None, *, on_gpu: bool = False, simulated: bool = False, world_size: int = 2
) -> tuple[str, ...]:
    """The mistakes a capstone is dealt from on `machine`: those of lab 05 whose cost shows there
    (`unprofiled_run.kinds_that_show`: on GPUs not the logged accuracy), and the OOM. Without `machine`, a
    machine on paper, as for `kinds_that_show`: `on_gpu`, a GPU node; `simulated`, a simulated one of
    `world_size` ranks.

    Where the lesson is judged by the course's targets (`Machine.judged_by_verdict`: on GPUs) not the
    per-tensor all-reduce either. The capstone's step is launch-bound there and three times lab 05's (two
    micro-batches, AdamW, a shared evaluation), and on its two ranks of a DGX H100 the 29 all-reduces, each
    about one host dispatch, add 0.39 ms to a 3.84 ms step: after/before 0.91 by
    `labkit.course.forecast.job_forecast`, short of the course's 0.8 (tests/course/test_forecast.py, which
    also shows every deal left showing). Lab 05, whose step is shorter, still draws it on GPUs.

    On a simulated machine neither, as on GPUs, nor the tokenizer in the loop (host Python, which a simulated
    GPU does not time): every seed deals the OOM and the straggler there. On two simulated H100s the
    straggler's fix takes the step from 8.78 to 7.04 ms (x0.80), on four x0.70."""
    if machine is not None:
        shows = set(kinds_that_show(machine))
        by_forecast = machine.judged_by_verdict
    else:
        shows = set(kinds_that_show(on_gpu=on_gpu, simulated=simulated, world_size=world_size))
        by_forecast = on_gpu or simulated
    left_out = {"per_tensor_allreduce"} if by_forecast else set()
    return tuple(k for k in DEALT if (k not in MYSTERY_KINDS or k in shows) and k not in left_out)


@dataclass(frozen=True)
class Capstone:
    """One dealt capstone: the model, the job as handed over (mistakes in it), its GPU's memory, the ranks.

    `planted` and `clean` are the answer key, kept out of the repr: the check reads them, you should not.
    """

    seed: int
    world_size: int
    model: GPTConfig
    job: TrainingJob
    memory_mib: float  # each rank's GPU memory for this job
    planted: tuple[str, ...] = dataclasses.field(repr=False)
    clean: TrainingJob = dataclasses.field(repr=False)


def clean_job(world_size: int) -> TrainingJob:
    """The capstone's job with nothing planted: AdamW, DDP with 1 MiB buckets, micro-batches of 4 accumulated
    to 8 sequences per rank, a shared held-out evaluation and a local accuracy every step."""
    job = TrainingJob(global_batch=8 * world_size, micro_batch=4, accuracy="local")
    return dataclasses.replace(job, eval_samples=held_out_samples(job, world_size))


def draw(
    seed: int,
    machine: Machine | None = None,
    *,
    world_size: int = 2,
    model: GPTConfig | None = None,
    memory_mib: float | None = None,
    on_gpu: bool = False,
    simulated: bool = False,
    secret: str | None = None,
) -> Capstone:
    """Deal the capstone of `seed` for `machine` (its ranks): two or three of `dealt(machine)` planted in one
    data-parallel job (both where it has only two: a simulated machine). Without `machine`, a machine on
    paper of `world_size` ranks, as for `dealt`: `on_gpu`, a GPU node; `simulated`, a simulated one.

    `model`: `MODEL`, or `GPU_MODEL` where a memory cap limits the caching allocator's segments
    (`Machine.caps_reserved`: GPUs, CI's fake ones too) or the lab takes its GPU sizes (`Machine.gpu_sized`:
    a simulated machine). `memory_mib`: each rank's GPU memory; by default 1.6x what the clean job's step
    needs by `labkit.memory.estimate` (Adam, fp32, micro-batch 4): room for the clean job and for the logging
    mistake's gathered logits, not for twice the micro-batch (measured on the default GPT, emulated: clean
    15.8 MiB, gathered logits 19.8 MiB, micro-batch 8 25.9 MiB, against 21.9 MiB); where the cap limits
    segments `SEGMENT_SLACK_MIB` more (a simulated GPU counts tensor bytes).

    `secret` (exam mode, `exam_secret()`): dealt from the seed and the secret together, so that another deal
    than `draw(seed)`'s comes out; the same seed and secret always deal the same job."""
    if machine is not None:
        world_size, segments, gpu_sequence = machine.ranks, machine.caps_reserved, machine.gpu_sized
    else:
        segments, gpu_sequence = on_gpu, simulated
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(
            f"world_size={world_size!r}: the capstone is a data-parallel job; use 2 or more ranks"
        )
    pool = dealt(machine, on_gpu=on_gpu, simulated=simulated, world_size=world_size)  # the flags: on paper
    model = model or (GPU_MODEL if segments or gpu_sequence else MODEL)
    # random.Random hashes a str seed with SHA-512 (CPython's random.seed, version 2): a stable deal per pair
    rng = random.Random(seed if secret is None else f"{secret}/{seed}")
    planted = tuple(sorted(rng.sample(pool, min(rng.choice((2, 3)), len(pool))), key=DEALT.index))
    clean = clean_job(world_size)
    job = clean
    for name in planted:
        job = MISTAKES[name].plant(job, world_size, rng)
    if memory_mib is None:
        # accumulating: the gradients stay beside the next micro-batch's activations
        need = estimate(
            model=model, micro_batch=clean.micro_batch, optimizer="adam", precision="fp32", keep_grads=True
        ).peak
        memory_mib = round(1.6 * need / _MIB + (SEGMENT_SLACK_MIB if segments else 0), 1)
    if isinstance(memory_mib, bool) or not isinstance(memory_mib, (int, float)) or not memory_mib > 0:
        raise ValueError(
            f"memory_mib={memory_mib!r} must be a number of MiB > 0; e.g. draw(seed, memory_mib=64)"
        )
    return Capstone(seed, world_size, model, job, float(memory_mib), planted, clean)


def train(
    cap: Capstone,
    jobs: Sequence[TrainingJob],
    trace_dir: str,
    *,
    steps: int = 2,
    warmup: int = 1,
    trace_steps: int = 3,
    same_core: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> list[JobResult]:
    """Every rank: each of `jobs` measured inside the capstone GPU's memory, timed and traced
    (`labkit.course.training.loop.train_jobs`), into `trace_dir/<index>_<knobs that differ from the clean
    job>/`.

    An OOM in a job's memory steps raises `torch.OutOfMemoryError` (the launch then raises `RankError`)."""
    if dist.get_world_size(process_group) != cap.world_size:
        raise ValueError(
            f"the capstone was dealt for {cap.world_size} ranks, launched on "
            f"{dist.get_world_size(process_group)}: launch(train, ..., world_size={cap.world_size})"
        )
    names = [f"{i}_{job_name(job, cap.clean)}" for i, job in enumerate(jobs)]
    return train_jobs(
        cap.model,
        jobs,
        trace_dir,
        names=names,
        steps=steps,
        warmup=warmup,
        trace_steps=trace_steps,
        memory_mib=cap.memory_mib,
        same_core=same_core,
        process_group=process_group,
    )


def _fit_memory(
    job: TrainingJob, model: GPTConfig, memory_mib: float, world_size: int, headroom: float = 0.9
) -> TrainingJob:
    """`job` with the largest micro-batch that divides a rank's share of the global batch and whose estimate
    fits `headroom` of `memory_mib` (what the notebook's exercise 1 asks for; ValueError when not even one
    sequence fits). Accumulating (micro-batch below the share), the gradients stay beside the next
    micro-batch's activations (`keep_grads`)."""
    share = job.global_batch // world_size
    for m in (d for d in range(share, 0, -1) if share % d == 0):
        need = estimate(model=model, micro_batch=m, optimizer="adam", precision="fp32", keep_grads=m < share)
        if need.peak <= headroom * memory_mib * _MIB:
            return dataclasses.replace(job, micro_batch=m)
    raise ValueError(
        f"not even a micro-batch of 1 fits {memory_mib} MiB: checkpointing, bf16 or sharding next"
    )


# ----------------------------------------------------------------- as a script
# (labkit.course.experiments.script)


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 06's parameters."""

    cluster: str = simulable_cluster()
    world_size: int = param(2, "data-parallel ranks", minimum=2)
    capstone_seed: int = param(
        0, "deals the job: which mistakes are planted (your instructor gives you one)", minimum=0
    )
    steps: int = param(2, "timed steps per run (after one warm-up step)", minimum=1)
    trace_steps: int = param(3, "profiled steps per run", minimum=1)
    trace_dir: str = param("traces_06", "the folder of the runs' traces (replaced on each run)")

    LAB = "06_capstone"
    NOTEBOOK_SIMULATED = True  # its exercises are the memory formula and the knobs; the jobs run there
    RANKS_WHY = "a data-parallel job: every GPU of the node (one GPU: 2 emulated ranks)"
    TEST = {"cluster": "cpu"}
    SMOKE = {"steps": 1, "trace_steps": 2}

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # any count of 2 or more: the job takes 8 sequences per rank (clean_job), so every rank's share and
        # its memory are the same on 8 ranks as on the 2 its GPU memory was replayed on
        return gpus if gpus >= 2 else None


def headline(w: Where, p: Params) -> LabRecords:
    """The capstone's records, found by measurement alone: the job as handed (its micro-batch cut to the
    largest whose estimate fits 90 % of the memory, if it runs out), then rounds of fixing the first finding
    of `labkit.trace.findings` that names a mistake, until the traces show none; the limit is the clean job,
    in the final launch."""
    cap = draw(
        p.capstone_seed, world_size=w.world_size, on_gpu=w.on_gpu, simulated=w.simulated, secret=exam_secret()
    )
    folder = Path(p.trace_dir).resolve()

    def attempt(jobs: list[TrainingJob], name: str) -> list[list[JobResult]] | None:
        try:
            per_rank = w.launch(
                train,
                cap,
                jobs,
                str(folder / name),
                steps=p.steps,
                trace_steps=p.trace_steps,
                timeout_s=p.timeout_s,
                deadline_s=p.timeout_s * 3,
            )
        except RankError as err:
            if (
                err.exc_type != "OutOfMemoryError"
            ):  # under torchrun only the rank that raised has its __cause__
                raise
            return None
        return [[rank[i] for rank in per_rank] for i in range(len(jobs))]

    found, job = [], cap.job
    runs = attempt([job], "as_handed")
    oom = runs is None
    if oom:
        found.append("oom_batch")
        job = _fit_memory(job, cap.model, cap.memory_mib, w.world_size)
        if (runs := attempt([job], "memory_fixed")) is None:
            raise RuntimeError(
                f"micro_batch={job.micro_batch} still runs out of {cap.memory_mib} MiB per rank"
            )
    before = step_ms(runs[0])
    rounds = [{"round": "as it runs", "step_ms": before}]
    seen = findings(Path(runs[0][0].traces))
    for i in range(len(DEALT)):  # bounded: one fix per round
        first = next((d for d in seen if by_diagnosis(d.kind) is not None), None)
        if first is None:
            break
        mistake = by_diagnosis(first.kind)
        found.append(mistake.name)
        if (runs := attempt([job := mistake.fixed(job)], f"round{i + 1}")) is None:
            raise RuntimeError(f"the fix for {first.kind} ran out of memory: {job}")
        seen = findings(Path(runs[0][0].traces))
        rounds.append({"round": f"{mistake.name} fixed", "found_as": first.kind, "step_ms": step_ms(runs[0])})
    if (final := attempt([job, cap.clean], "final")) is None:
        raise RuntimeError(f"the fixed job or the clean one ran out of {cap.memory_mib} MiB per rank")
    peaks = {
        "fixed": max(r.peak_mib for r in final[0]),
        "clean": max(r.peak_mib for r in final[1]),
        "memory": cap.memory_mib,
    }
    return LabRecords(
        before,
        step_ms(final[0]),
        step_ms(final[1]),
        "ms",
        Meaning(
            before="step time of the job as it first ran (after its memory fix, if it did not fit)",
            after="step time with every mistake the traces pointed to fixed",
            limit="the same job with nothing planted, in the same launch as after: a reference, not a bound",
        ),
        "step time of a job with two or three planted mistakes, before and after finding and fixing them",
        {
            "seed": p.capstone_seed,
            "oom_at_start": oom,
            "found": sorted(found),
            "rounds": rounds,
            "job_fixed": dataclasses.asdict(job),
            "peak_mib": peaks,
            "clean_spread_ms": (spread := step_spread_ms(*final)),
            "versus_clean": versus_clean(step_ms(final[0]), step_ms(final[1]), spread, w.label),
        },
    )


if __name__ == "__main__":
    main(__spec__.name)
