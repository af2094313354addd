"""Lab 03's driver: time data-parallel steps the naive way, the overlapped way and torch DDP's way.

`train_steps` runs on every rank (launch it with `labkit.launch`): each mode of `MODES` trains its own copy of
the same seeded GPT with the course's one training job (`labkit.course.training.Trainer`, SGD, the gradient
sync of the mode), step by step, next to compute alone and communication alone, and every training step is
checked against a single-process run on the whole batch (`labkit.course.training.reference`).
`summarize_steps` combines the ranks' results.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labkit import validate
from labkit.course.experiments.params import LabParams, gpt_param, param, simulable_cluster
from labkit.course.experiments.script import LabRecords, Meaning, Where, main
from labkit.course.training.job import TrainingJob
from labkit.course.training.overlapped import bucket_summary
from labkit.course.training.reference import max_abs_diff, reference_backward
from labkit.course.training.trainer import Trainer
from labkit.machine import emulate, runtime, timer
from labkit.models import GPTConfig, seeded_model
from labkit.parallel.data import OverlappedDDP
from labkit.trace.capture import capture
from labkit.trace.commlog import CommLog
from labkit.trace.device import device_trace_path, write_device_trace
from labkit.trace.timeline import overlap, read_trace

__all__ = [
    "MODES",
    "Mode",
    "ModeSteps",
    "ModeSummary",
    "Params",
    "RankSteps",
    "headline",
    "summarize_steps",
    "train_steps",
]


@dataclass(frozen=True)
class Mode:
    """One way of doing a data-parallel step: the job's gradient sync, and whether it computes at all."""

    grad_sync: str  # TrainingJob.grad_sync
    communication_only: bool = False  # the mode's collectives with zero gradients, no compute
    trains: bool = False  # updates the model data-parallel, so it is checked against the reference


MODES: dict[str, Mode] = {
    "compute": Mode("none"),  # forward, backward, optimizer step: compute alone
    "comm_naive": Mode("per_tensor", communication_only=True),
    "naive": Mode("per_tensor", trains=True),  # the mistake: every gradient all-reduced after backward
    "comm_overlapped": Mode("overlapped", communication_only=True),
    "overlapped": Mode("overlapped", trains=True),  # OverlappedDDP: buckets from gradient hooks
    "torch_ddp": Mode("ddp", trains=True),  # torch DDP, its bucket all-reduces counted
}


@dataclass
class ModeSteps:
    """One mode's timed steps on one rank (ms on `labkit.machine.timer.clock`, after the warm-up)."""

    steps_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # the whole process's CPU time (all threads) per step
    waited_ms: list[float | None] = field(default_factory=list)  # waiting for collectives (virtual clock)
    collectives: list[int] = field(default_factory=list)
    in_backward: list[int] = field(default_factory=list)  # collectives launched before backward() returned
    buckets: int | None = None  # the overlapped modes' bucket count
    bucket_summary: list[dict[str, Any]] | None = None
    max_abs_diff: list[float] | None = None  # after every step, warm-up included; None: not checked


@dataclass
class RankSteps:
    """What `train_steps` measured on one rank."""

    modes: dict[str, ModeSteps]
    traces: dict[str, str]  # mode -> host trace
    device_traces: dict[str, str]  # mode -> device timeline (the emulated cluster's virtual clock)
    param_tensors: int
    params: int
    grad_bytes: int
    rank: int
    world_size: int
    device: str


@dataclass(frozen=True)
class ModeSummary:
    """One mode over every rank: each step is as slow as its slowest rank; medians over steps (ms)."""

    step_ms: float
    steps_ms: list[float]
    compute_ms: float | None  # the step less its waits for collectives, slowest rank (virtual clock only)
    cpu_ms: float  # CPU time per step (median per rank, mean over ranks)
    collectives: int  # per step
    in_backward: int | None
    buckets: int | None
    max_abs_diff: float | None  # the worst parameter difference against the single-process reference


def _check_modes(modes: Sequence[str], trace_modes: Sequence[str], steps: int, warmup: int) -> None:
    bad = [m for m in list(modes) + list(trace_modes) if m not in MODES]
    if bad:
        raise ValueError(f"train_steps: unknown mode(s) {bad}; choose from {list(MODES)}.")
    missing = [m for m in trace_modes if m not in modes]
    if missing:
        raise ValueError(f"train_steps: trace_modes {missing} must also be in modes={list(modes)}.")
    validate.positive_int("train_steps steps", steps, "train_steps(modes, steps=5)")
    validate.non_negative_int("train_steps warmup", warmup, "train_steps(modes, warmup=1)")


def _one_step(mode: Mode, trainer: Trainer) -> None:
    if mode.communication_only:
        trainer.communicate_only()
    else:
        trainer.step()


def _timed(mode: Mode, trainer: Trainer) -> tuple[float, float, float, float | None]:
    """(ms, process CPU ms, start, ms waiting for collectives or None) of one step on
    `labkit.machine.timer.clock`, after a barrier. The CPU time is the host's work on the step only: on a GPU
    `timer.clock` synchronizes the device, and that wait spins the CPU (CUDA's default), so it is read after
    the first reading of the clock and before the second."""
    dist.barrier(group=trainer.process_group)
    w0, t0 = timer.waited(), timer.clock()
    cpu0 = time.process_time()
    _one_step(mode, trainer)
    cpu_ms = (time.process_time() - cpu0) * 1e3
    ms = (timer.clock() - t0) * 1e3
    return ms, cpu_ms, t0, (timer.waited() - w0) * 1e3 if w0 is not None else None


def _record(row: ModeSteps, trainer: Trainer, ms: float, cpu_ms: float, waited_ms: float | None) -> None:
    row.steps_ms.append(ms)
    row.cpu_ms.append(cpu_ms)
    row.waited_ms.append(waited_ms)
    row.collectives.append(trainer.sync.collectives)
    row.in_backward.append(trainer.sync.in_backward)


def train_steps(
    modes: Sequence[str] = ("compute", "naive", "overlapped"),
    config: GPTConfig | None = None,
    micro_batch: int = 16,
    *,
    steps: int = 5,
    warmup: int = 1,
    bucket_cap_mb: float = 25.0,
    lr: float = 0.1,
    seed: int = 0,
    check: bool = True,
    ddp_class: type[OverlappedDDP] | None = None,
    trace_modes: Sequence[str] = (),
    trace_dir: str | None = None,
    trace_steps: int = 2,
    process_group: dist.ProcessGroup | None = None,
) -> RankSteps:
    """Time data-parallel training steps of a `labkit.models.GPT`, several ways; every rank calls it.

    `modes` (any of `MODES`), each on its own copy of the same initial model, with SGD: "compute" (no
    communication), "naive" (the mistake, `allreduce_gradients_naive` after backward), "overlapped"
    (`ddp_class`, default `CourseOverlappedDDP`, with `bucket_cap_mb`), "torch_ddp" (torch's DDP with the
    same buckets), and "comm_naive" / "comm_overlapped" (the collectives of "naive" / "overlapped", same sizes
    and count, zero gradients, nothing else: communication alone).

    The modes take turns step by step (all do step 1, then step 2, ...), so a slow spell of a noisy machine
    hits them all; a barrier precedes every timed step. Each rank trains on its `micro_batch` rows of a global
    batch of `micro_batch x world_size`. With `check`, every rank also runs a single-process reference on the
    whole global batch and, after every step, records the largest absolute parameter difference of each
    training mode against it. Afterwards the modes in `trace_modes` are profiled for `trace_steps` steps
    (after one warm-up) with `labkit.trace.capture`, one file per mode and rank; on the emulated cluster's
    virtual clock the device timeline of the last `trace_steps` timed steps is written next to each.
    Combine the ranks with `summarize_steps`.
    """
    _check_modes(modes, trace_modes, steps, warmup)
    config = config if config is not None else GPTConfig()
    dev = runtime.device()
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    global_batch = micro_batch * world
    trainers = {
        m: Trainer(
            TrainingJob(
                global_batch=global_batch,
                micro_batch=micro_batch,
                optimizer="sgd",
                lr=lr,
                grad_sync=MODES[m].grad_sync,
                bucket_cap_mb=bucket_cap_mb,
                seed=seed,
            ),
            config,
            steps=warmup + steps + 1 + trace_steps,
            process_group=process_group,
            ddp_class=ddp_class,
            comm_log=CommLog(),  # the host trace's communication lane (capture merges it)
        )
        for m in modes
    }
    # a simulated machine computes no values: nothing to check there (the emulated cluster checks them)
    check = check and not runtime.on_simulated()
    checked = [m for m in modes if MODES[m].trains] if check else []
    ref = seeded_model(config, seed, dev) if checked else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr) if ref is not None else None
    out = {m: _steps_of(trainers[m], m in checked) for m in modes}
    windows: dict[str, list] = {m: [] for m in modes}  # (step, start, end) on timer.clock
    for s in range(warmup + steps):
        for m in modes:
            ms, cpu_ms, t0, waited_ms = _timed(MODES[m], trainers[m])
            if s >= warmup:
                windows[m].append((s, t0, t0 + ms / 1e3))
                _record(out[m], trainers[m], ms, cpu_ms, waited_ms)
        if ref is not None:
            reference_backward(ref, config, global_batch, step=s, seed=seed)
            ref_opt.step()
            for m in checked:
                out[m].max_abs_diff.append(max_abs_diff(trainers[m].model, ref))
    traces, device_traces = _trace(trainers, trace_modes, windows, trace_dir, trace_steps, rank)
    params = [p for p in trainers[modes[0]].model.parameters() if p.requires_grad]
    return RankSteps(
        out,
        traces,
        device_traces,
        len(params),
        sum(p.numel() for p in params),
        sum(p.numel() * p.element_size() for p in params),
        rank,
        world,
        str(dev),
    )


def _steps_of(trainer: Trainer, checked: bool) -> ModeSteps:
    ddp = getattr(trainer.sync, "ddp", None)
    overlapped = isinstance(ddp, OverlappedDDP)
    return ModeSteps(
        buckets=len(ddp.buckets) if overlapped else None,
        bucket_summary=bucket_summary(ddp.buckets) if overlapped else None,
        max_abs_diff=[] if checked else None,
    )


def _trace(
    trainers: dict[str, Trainer],
    trace_modes: Sequence[str],
    windows: dict[str, list],
    trace_dir: str | None,
    trace_steps: int,
    rank: int,
) -> tuple[dict[str, str], dict[str, str]]:
    """Profile each of `trace_modes`; on the virtual clock also write the device timeline of its timed
    steps."""
    traces, device_traces = {}, {}
    folder = Path(trace_dir) if trace_dir else Path(tempfile.gettempdir()) / "labkit_traces"
    group = next(iter(trainers.values())).process_group if trainers else None
    for m in trace_modes:
        trainer = trainers[m]
        trainer.log.clear()
        dist.barrier(group=group)
        path = capture(
            lambda mode=MODES[m], t=trainer: _one_step(mode, t),
            steps=trace_steps,
            warmup=1,
            path=folder / f"{m}_rank{{rank}}.json",
            comm_log=trainer.log,
            device_trace=False,
        )
        traces[m] = str(path)
        if runtime.on_virtual_clock():  # the device timeline of the timed (unprofiled) steps, in virtual time
            device = write_device_trace(
                device_trace_path(path), emulate.rank_clock(), windows[m][-trace_steps:], rank
            )
            device_traces[m] = str(device)
    dist.barrier(group=group)
    return traces, device_traces


def _own_compute_ms(per_rank: list[ModeSteps]) -> float | None:
    """Median over steps of the slowest rank's step time less its waits (None without waits)."""
    if any(not pr.waited_ms or None in pr.waited_ms for pr in per_rank):
        return None
    own = zip(*([ms - w for ms, w in zip(pr.steps_ms, pr.waited_ms)] for pr in per_rank))
    return statistics.median(max(step) for step in own)


def summarize_steps(results: Sequence[RankSteps]) -> dict[str, ModeSummary]:
    """Combine `train_steps` results of all ranks: per mode, a `ModeSummary`.

    A data-parallel step is as slow as its slowest rank, so each step's time is the maximum over ranks; the
    median over steps is then robust to a noisy machine.
    """
    if not results:
        raise ValueError("summarize_steps got no results; pass the list that labkit.launch returned.")
    summary = {}
    for m in results[0].modes:
        per_rank = [r.modes[m] for r in results]
        step_max = [max(ms) for ms in zip(*(pr.steps_ms for pr in per_rank))]
        diffs = [d for pr in per_rank for d in (pr.max_abs_diff or [])]
        first = per_rank[0]
        summary[m] = ModeSummary(
            step_ms=statistics.median(step_max),
            steps_ms=step_max,
            compute_ms=_own_compute_ms(per_rank),
            cpu_ms=statistics.mean(statistics.median(pr.cpu_ms) for pr in per_rank),
            collectives=first.collectives[-1] if first.collectives else 0,
            in_backward=first.in_backward[-1] if first.in_backward else None,
            buckets=first.buckets,
            max_abs_diff=max(diffs) if diffs else None,
        )
    return summary


# ----------------------------------------------------------------- as a script
# (labkit.course.experiments.script)


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 03's parameters."""

    cluster: str = simulable_cluster()

    world_size: int = param(
        2,
        "data-parallel ranks, one per GPU or emulated GPU; overlap needs two (one rank all-reduces nothing)",
        minimum=2,
    )
    n_layers: int = gpt_param("n_layers", 6, "each block has 12 parameter tensors")
    d_model: int = gpt_param("d_model", 128)
    seq_len: int = gpt_param("seq_len", 64)
    micro_batch: int = param(
        12, "sequences per rank and step (compute comparable with communication)", minimum=1
    )
    bucket_cap_mb: float = param(
        0.5,
        "bucket size limit in MiB (torch DDP's default is 25 MiB; this model has ~5 MB of gradients)",
        minimum=0,
        strict=True,
    )
    sweep_caps_mb: list[float] = param(
        [1e-6, 0.125, 0.5, 2.0],
        "bucket sizes to sweep (1e-6: one per tensor); one bucket for the whole model is added",
        minimum=0,
        strict=True,
    )
    steps: int = param(5, "timed steps per measurement (medians are reported)", minimum=1)
    warmup: int = param(1, "untimed steps first", minimum=0)
    trace_dir: str = param("traces_03", "the folder of the traces (replaced on each run)")

    GPT_FIXED = {"n_heads": 4, "vocab_size": 256}
    # fp32 on a GPU node: 256 tokens per rank against 400 M parameters' gradients, so that all-reducing
    # them costs about as much as the step's compute on NVLink (labkit.course.forecast.overlap_forecast and
    # tests/course/test_forecast.py: on a DGX H100, after/before 0.73 on 4 ranks, 0.63 on 8; on 2, 0.87, too
    # little: the buckets' two extra passes over the gradients cost about what the hidden all-reduce
    # does, and the notebook says so and forecasts the whole node). The emulated sizes
    # (d_model 128, 12 x 64 tokens) would be launch-bound there, and the old suggestion (d_model 1024,
    # 8 x 512 tokens) 86 ms of compute against 5 ms of bucketed all-reduce
    GPU_SIZES = {
        "d_model": 2048,
        "n_layers": 8,
        "seq_len": 128,
        "micro_batch": 2,
        "bucket_cap_mb": 25.0,
        "sweep_caps_mb": [1e-6, 25.0, 100.0, 400.0],
    }
    LAB = "03_unoverlapped_comms"
    NOTEBOOK_SIMULATED = True  # its exercise is checked on the emulated cluster, the rest runs there
    RANKS_WHY = (
        "its lesson is gradient communication between ranks: every GPU of the node, where it shows from "
        "4 on (one GPU: 2 emulated ranks)"
    )
    # 3 timed steps, not 5: a median of 3 still ignores one slow step
    TEST = {"cluster": "cpu", "steps": 3}
    SMOKE = {"n_layers": 2, "d_model": 32, "seq_len": 16, "micro_batch": 4, "steps": 2}

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # any count of 2 or more: each rank takes micro_batch sequences (no global batch to divide); the
        # all-reduce grows with the ranks, so the lesson shows on 4 and 8 and not on 2 (after/before 0.73,
        # 0.63 and 0.87 on a DGX H100, labkit.course.forecast.overlap_forecast: tests/course/test_forecast.py)
        return gpus if gpus >= 2 else None

    def check(self) -> None:
        self.check_multiple("d_model", 4, "the lab's GPT has 4 attention heads")


def headline(w: Where, p: Params) -> LabRecords:
    """Lab 03's records: the step with per-tensor all-reduces after backward, with buckets during backward,
    and max(compute, bucketed communication alone) from the same launch; overlap % from the traces."""
    modes = ["compute", "naive", "comm_overlapped", "overlapped"]
    run = w.launch(
        train_steps,
        modes,
        p.config(),
        p.micro_batch,
        steps=p.steps,
        warmup=p.warmup,
        bucket_cap_mb=p.bucket_cap_mb,
        trace_modes=["naive", "overlapped"],
        trace_dir=str(Path(p.trace_dir).resolve()),
        timeout_s=p.timeout_s,
        alike=True,  # data-parallel ranks: on a simulated node one process stands for them (rank 0's traces)
    )
    s = summarize_steps(run)
    own = s["overlapped"].compute_ms  # the step less its waits, on the virtual clock; else compute alone
    limit = max(own if own is not None else s["compute"].step_ms, s["comm_overlapped"].step_ms)
    pct = {
        m: statistics.mean(
            overlap(read_trace(r.device_traces.get(m) or r.traces[m]))["overlap_pct"] for r in run
        )
        for m in ("naive", "overlapped")
    }
    return LabRecords(
        s["naive"].step_ms,
        s["overlapped"].step_ms,
        limit,
        "ms",
        Meaning(
            before="data-parallel step, every gradient all-reduced after backward (median, slowest rank)",
            after=f"step with {p.bucket_cap_mb} MiB buckets all-reduced from gradient hooks during backward",
            limit="max(compute, bucketed communication alone), measured in the same launch",
        ),
        "data-parallel step time: per-tensor all-reduce after backward vs buckets during backward",
        {
            "compute_ms": s["compute"].step_ms,
            "own_compute_ms": own,
            "comm_ms": s["comm_overlapped"].step_ms,
            "overlap_pct_before": pct["naive"],
            "overlap_pct_after": pct["overlapped"],
            "collectives_before": s["naive"].collectives,
            "collectives_after": s["overlapped"].collectives,
            # None on a simulated machine, which computes no values
            "max_abs_diff": None if w.simulated else max(s[m].max_abs_diff for m in ("naive", "overlapped")),
            "traces": run[0].traces,
        },
    )


if __name__ == "__main__":
    main(__spec__.name)
