"""Lab 02's driver: data-parallel steps with gradient accumulation under DDP, and their memory.

Run on a launched rank (``labkit.launch``), under the rank's memory limit (the emulated budget or a GPU's
memory cap):

* ``dp_train``: optimizer steps of one global batch each of the course's one training job
  (``labkit.course.training.Trainer``: Adam, torch DDP), the micro-batches run by ``accumulate(ddp, batches)``
  (``labkit.parallel.data.accumulate_with_no_sync`` by default), counting DDP's all-reduces and measuring the
  peak of the last step (``labkit.machine.device_memory.step_peak``);
* ``max_micro_batch``: ``labkit.find_max_batch`` for one rank's training step;
* ``rank_micro_batches``: the data split the accumulation is checked against
(``labkit.course.training.reference``
  has the single-process big-batch gradient).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import validate
from labkit.batch import accumulation_steps
from labkit.course.experiments.params import LabParams, ParamError, gpt_param, param, simulable_cluster
from labkit.course.experiments.script import LabRecords, Meaning, Where, main
from labkit.course.training.job import TrainingJob
from labkit.course.training.reference import rank_rows
from labkit.course.training.trainer import Trainer
from labkit.machine import device_memory, runtime
from labkit.machine.machine import Machine
from labkit.machine.timer import Span
from labkit.measured_memory import BatchSearch, find_max_batch, free_memory, measure
from labkit.memory import MemoryBreakdown, estimate
from labkit.models import PRESETS, GPTConfig, synthetic_batch
from labkit.parallel.data import accumulate_with_no_sync

__all__ = [
    "DPResult",
    "Params",
    "dp_train",
    "fixed_micro_batch",
    "headline",
    "max_micro_batch",
    "rank_micro_batches",
]

_MIB = 2**20


def rank_micro_batches(
    config: GPTConfig,
    global_batch: int,
    micro_batch: int,
    rank: int,
    world_size: int,
    *,
    step: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches ``[(x, y), ...]`` of global batch number ``step``.

    Rank r takes its rows of the global batch (``labkit.course.training.reference.rank_rows``) and cuts them
    into ``micro_batch`` rows each. Any split of the same global batch therefore sees the same samples, so its
    gradient can be compared with ``labkit.course.training.reference.reference_gradients``.
    """
    steps = accumulation_steps(global_batch, micro_batch, world_size)
    x, y = rank_rows(config, global_batch, rank, world_size, step=step, seed=seed, device=device)
    return [
        (x[i * micro_batch : (i + 1) * micro_batch], y[i * micro_batch : (i + 1) * micro_batch])
        for i in range(steps)
    ]


def _host_flat(tensors: list[torch.Tensor]) -> Any:
    """One flat numpy copy of ``tensors`` in host memory, which the device budget does not count (``.cpu()``
    copies on a GPU; on CPU numpy copies outside torch's dispatcher, and no tensor is made from it here:
    ``torch.from_numpy`` under the emulated budget is counted)."""
    import numpy as np

    parts = [t.detach().cpu().numpy().reshape(-1) for t in tensors]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class DPResult:
    """What one rank of ``dp_train`` measured on its last optimizer step."""

    rank: int
    world_size: int
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    precision: str
    checkpointing: bool
    peak_bytes: int  # peak memory of the last optimizer step on this rank
    peak_source: str  # "emulated budget" or "torch.cuda.max_memory_allocated, net of the warm baseline"
    reserved_peak_bytes: int  # the allocator's reserved peak of that step (a GPU's cap limits it)
    allreduce_calls: int  # bucket all-reduces DDP issued in the last optimizer step
    buckets: int  # DDP's buckets (distinct bucket indices seen in that step)
    allreduce_bytes: int  # bytes of gradient buckets all-reduced in that step
    step_ms: float  # the last optimizer step on the rank's timer (MemTracker slows it when used)
    loss: float  # mean loss over this rank's share of the last global batch
    grads_array: Any = None  # numpy: first step's gradients, flattened (return_grads=True)
    breakdown: MemoryBreakdown | None = None  # MemTracker categories at the peak

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / _MIB

    @property
    def grads(self) -> torch.Tensor | None:
        """The first step's gradients as a flat CPU tensor (None without ``return_grads``)."""
        return None if self.grads_array is None else torch.from_numpy(self.grads_array)


_DP_PRECISIONS = ("fp32", "autocast")


def dp_train(
    config: GPTConfig,
    global_batch: int,
    micro_batch: int,
    *,
    accumulate: Callable[[nn.Module, list], Any] | None = None,
    precision: str = "fp32",
    checkpointing: bool = False,
    optimizer_steps: int = 2,
    bucket_cap_mb: float = 1.0,
    seed: int = 0,
    breakdown: bool = False,
    return_grads: bool = False,
) -> DPResult:
    """Data-parallel training steps of ``GPT(config)`` on this rank; run it with ``labkit.launch``.

    Each optimizer step processes one global batch: ``micro_batch`` samples x ``accumulation_steps(...)``
    micro-steps x world_size ranks, through ``accumulate(ddp, batches)`` (default
    ``accumulate_with_no_sync``), then Adam. DDP keeps the gradients in its buckets
    (``gradient_as_bucket_view=True``, no second copy) and they are zeroed in place: with ``set_to_none=True``
    the gradients of micro-steps under ``no_sync`` are new tensors next to the buckets (measured: +1 gradient
    copy, 57.1 instead of 53.5 MiB on a 3.6 MiB-gradient model). A comm hook counts DDP's bucket all-reduces.
    Step 1 creates Adam's states and lets DDP rebuild its buckets in gradient order (torch 2.13 puts all
    parameters in one bucket for the first step), so the counts and the peak come from the last step.
    ``breakdown`` runs that step under ``measure`` (MemTracker); ``return_grads`` returns step 1's gradients
    (before any update), flattened in parameter order, as a host copy. Where nothing else counts memory (a
    torchrun rank on CPUs) a budget that only counts does."""
    if not dist.is_initialized():
        raise ValueError("dp_train runs on a rank: call it as labkit.launch(dp_train, config, ...)")
    validate.positive_int("optimizer_steps", optimizer_steps, "dp_train(config, 64, 16, optimizer_steps=2)")
    validate.one_of("precision", precision, _DP_PRECISIONS, "'autocast' (bf16 autocast) or 'fp32'")
    accumulate = accumulate_with_no_sync if accumulate is None else accumulate
    # Several runs can share a rank (e.g. one launch comparing options): let the collector
    # free what earlier ones left in reference cycles, so the peak counts this run only.
    free_memory()
    job = _lab_job(global_batch, micro_batch, precision, checkpointing, bucket_cap_mb, seed)
    with device_memory.tracked():
        trainer = Trainer(job, config, steps=optimizer_steps)
        grads: Any = None  # numpy copy of the first step's gradients
        losses: list[torch.Tensor] = []

        def one_step(step: int) -> None:
            nonlocal grads
            losses.append(trainer.forward_backward(accumulate))
            if return_grads and step == 0:
                grads = _first_gradients(trainer.model)
            trainer.update()

        for step in range(optimizer_steps - 1):
            one_step(step)
        measured: MemoryBreakdown | None = None

        def last_step() -> None:
            nonlocal measured
            last = optimizer_steps - 1
            if breakdown:
                measured = measure(lambda: one_step(last), trainer.model, trainer.opt, warmup=False)
            else:
                one_step(last)

        with Span() as span:
            _, peak = device_memory.step_peak(last_step)
    calls = trainer.sync.calls
    return DPResult(
        rank=trainer.rank,
        world_size=trainer.world,
        global_batch=global_batch,
        micro_batch=micro_batch,
        accumulation_steps=trainer.acc,
        precision=precision,
        checkpointing=checkpointing,
        peak_bytes=peak.peak_bytes,
        peak_source=peak.source,
        reserved_peak_bytes=peak.reserved_peak_bytes,
        allreduce_calls=len(calls),
        buckets=len({index for index, _ in calls}),
        allreduce_bytes=sum(nbytes for _, nbytes in calls),
        step_ms=span.ms,
        loss=runtime.value_of(losses[-1]),  # NaN on a simulated machine, which computes no values
        grads_array=grads,
        breakdown=measured,
    )


def _lab_job(
    global_batch: int, micro_batch: int, precision: str, checkpointing: bool, bucket_cap_mb: float, seed: int
) -> TrainingJob:
    """The lab's training job: Adam under DDP (labkit's OverlappedDDP on a simulated machine,
    `training.grad_sync.make_grad_sync`), as `dp_train` and the batch finder's trials run it."""
    return TrainingJob(
        global_batch=global_batch,
        micro_batch=micro_batch,
        optimizer="adam",
        lr=1e-3,
        precision=precision,
        checkpointing=checkpointing,
        grad_sync="ddp",
        bucket_cap_mb=bucket_cap_mb,
        seed=seed,
    )


def _first_gradients(model: nn.Module) -> Any:
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    if missing:
        raise ValueError(f"no gradient for {missing[:3]}...: did accumulate call backward()?")
    return _host_flat([p.grad for p in model.parameters()])


def max_micro_batch(
    config: GPTConfig,
    *,
    precision: str = "fp32",
    checkpointing: bool = False,
    bucket_cap_mb: float = 1.0,
    start: int = 1,
    limit: int = 4096,
    seed: int = 0,
) -> BatchSearch:
    """``find_max_batch`` for one rank's training step of ``GPT(config)`` on this device.

    Run it where the memory limit is (``labkit.launch`` on a cluster with ``memory_gib``: the emulated budget,
    or the GPU with its memory cap). Each trial is the lab's step, as ``dp_train`` runs it: the course's
    training job under DDP with Adam, one micro-batch of the trial's size, after a step of one sequence that
    makes Adam's states and lets DDP rebuild its buckets. On a GPU a cap limits the allocator's reserved
    segments, so only the lab's own tensors, buckets and optimizer temporaries say whether it fits: a plain
    step without DDP passed the H200's cap where the lab's step then ran out. The DDP of a trial spans this
    rank alone (every rank makes its group of one here), so an OOM on one rank never leaves another waiting in
    a collective.
    """
    validate.one_of("precision", precision, _DP_PRECISIONS, "'autocast' (bf16 autocast) or 'fp32'")
    free_memory()  # what earlier runs on this rank left in reference cycles
    alone, _ = dist.new_subgroups(group_size=1)

    def step(batch: int) -> None:
        job = _lab_job(batch, batch, precision, checkpointing, bucket_cap_mb, seed)
        trainer = Trainer(job, config, steps=2, process_group=alone)
        # a first step of one sequence makes Adam's states and lets DDP rebuild its buckets, as dp_train's
        # first step does, for a fraction of the trial's compute
        one = synthetic_batch(config, 1, seed=seed, device=trainer.dev)
        trainer.forward_backward(lambda module, batches: module(*one).backward())
        trainer.update()
        trainer.forward_backward(accumulate_with_no_sync)  # the trial: one micro-batch of `batch` sequences
        trainer.update()

    return find_max_batch(step, start=start, limit=limit)


# ----------------------------------------------------------------- as a script
# (labkit.course.experiments.script)


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 02's parameters."""

    cluster: str = simulable_cluster()
    world_size: int = param(
        2, "data-parallel ranks, one per GPU or emulated GPU (on a machine with one GPU: 1, on it)", minimum=1
    )
    memory_mib: float = param(
        28,
        "memory of each rank: the emulated budget, or that much of each GPU above its warm baseline",
        minimum=0,
        strict=True,
    )
    global_batch: int | None = param(
        None,
        "sequences per optimizer step, summed over all ranks (None: 32 per rank, 64 on GPUs)",
        minimum=1,
        example=64,
    )
    micro_batch: int = param(4, "sequences per forward/backward in the accumulation exercise", minimum=1)
    n_layers: int = gpt_param("n_layers", 4)
    d_model: int = gpt_param("d_model", 128)
    n_heads: int = gpt_param("n_heads", 4)
    vocab_size: int = gpt_param("vocab_size", 512)
    seq_len: int = gpt_param("seq_len", 64)
    bucket_cap_mb: float = param(
        1.0,
        "DDP bucket size (DDP's default is 25; small here, so the model has several buckets)",
        minimum=0,
        strict=True,
    )
    big_preset: str = param(
        "llama2-7b",
        "a model too large for this machine, estimated without allocating it",
        choices=tuple(sorted(PRESETS)),
    )
    big_card_gib: float = param(80, "... against one card of this many GiB", minimum=0, strict=True)
    frag_limit_mib: int = param(
        180, "memory for the fragmentation section (its pattern: 160, 8 x 20, then 40 MiB)", minimum=1
    )

    # On a GPU the cap is on what CUDA's caching allocator *reserves*, and it reserves in segments (2 MiB for
    # blocks up to 1 MiB, 20 MiB for blocks up to 10 MiB: c10/cuda/CUDACachingAllocator.cpp, kSmallBuffer and
    # kLargeBuffer), so a step of this small model reserves some 10-18 MiB more than it allocates, and one
    # more CUDA-only tensor of a few MiB (a workspace, a cast cache, NCCL's buffers) takes a new 20 MiB
    # segment.
    # Replayed through labkit's model of that allocator (tests/course/experiments/test_oom_batch_gpu.py and
    # the notebook on CI's fake CUDA machine): the fixed step (autocast + checkpointing, micro-batch 32 x 2)
    # allocates 32 MiB and reserves 42, so a cap of 48 MiB (the one H200 run: "Tried to allocate 20.00 MiB")
    # leaves 6 MiB; 64 MiB leaves a large segment's 20 (labkit.machine.machine.LARGE_SEGMENT_BYTES), while the
    # step as written (171 MiB allocated) still runs out. 64 sequences per rank so that the fix still
    # accumulates.
    GPU_SIZES = {"memory_mib": 64.0}
    GPU_SEQUENCES_PER_RANK = 64
    LAB = "02_oom_batch"
    # its exercise's gradients are checked on the emulated cluster; the rest runs on the simulated machine
    NOTEBOOK_SIMULATED = True
    RANKS_WHY = (
        "its lessons are one rank's memory, which more ranks do not change: 2 ranks (DDP's all-reduce, which "
        "no_sync skips), 1 on a one-GPU machine (DDP on one rank still buckets and all-reduces)"
    )
    TEST = {"cluster": "cpu", "big_preset": "gpt2"}  # FakeTensors of gpt2, not of 7B: 1 s, not 9
    # the per-rank share stays 32 at any world size: the step as written needs 4.3 MiB, the fixed one 0.7
    SMOKE = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "seq_len": 16, "memory_mib": 1.0}

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # one rank on a one-GPU machine rather than two emulated ones beside an idle GPU; on several GPUs its
        # default 2: the per-rank memory is the same on 8, and the global batch (64 per rank) would only grow
        return 1 if gpus == 1 else None

    def check(self) -> None:
        self.check_multiple(
            "d_model",
            self.n_heads,
            f"each of the n_heads={self.n_heads} heads gets d_model / n_heads channels",
        )

    def resolve(self, *, on_gpu: bool = False) -> Params:
        p = self.gpu_sized(on_gpu)
        per_rank = self.GPU_SEQUENCES_PER_RANK if on_gpu else 32
        p = p if p.global_batch is not None else replace(p, global_batch=per_rank * p.world_size)
        p.check_multiple(
            "global_batch",
            p.world_size,
            f"every one of the world_size={p.world_size} ranks takes an equal share",
        )
        share = p.global_batch // p.world_size
        if share % p.micro_batch:
            raise ParamError(
                "micro_batch",
                p.micro_batch,
                f"a divisor of the {share} sequences per rank",
                max(d for d in range(1, p.micro_batch + 1) if share % d == 0),
                why=f"global_batch={p.global_batch} over {p.world_size} ranks",
            )
        return p



def fixed_micro_batch(p: Params, machine: Machine | None = None) -> tuple[int, MemoryBreakdown]:
    """The fixed step's micro-batch: the largest divisor of the per-rank batch whose estimate with bf16
    autocast and activation checkpointing (`labkit.memory.estimate`, with the machine's optimizer and
    gradient sync) fits `memory_mib`, less the room the machine's allocator needs for its segments
    (`Machine.allocator_headroom_bytes`: one large segment on a GPU), and that estimate."""
    machine = machine or p.machine()
    per_rank, config = p.global_batch // p.world_size, p.config()
    estimates = {
        m: estimate(model=config, precision="autocast", checkpointing=True, micro_batch=m, keep_grads=True,
                    foreach=machine.optimizer_foreach)
        for m in range(per_rank, 0, -1)
        if per_rank % m == 0
    }  # largest first
    room = p.memory_mib * _MIB - machine.allocator_headroom_bytes
    micro = next(
        (m for m, e in estimates.items() if e.peak + machine.grad_sync_extra_bytes(e.grads) <= room), None
    )
    if micro is None:
        raise ParamError(
            "memory_mib",
            p.memory_mib,
            "enough for a micro-batch of 1 with autocast and checkpointing",
            round(estimates[1].peak / _MIB * 1.2, 1),
        )
    return micro, estimates[micro]


def headline(w: Where, p: Params) -> LabRecords:
    """Lab 02's records: peak memory per rank of the step as first written and with the fixes, against the
    memory.

    The fixed step: bf16 autocast and activation checkpointing at the largest micro-batch whose estimate
    (`labkit.memory.estimate`) fits `memory_mib`, accumulated under `no_sync` to the same global batch. On the
    emulated cluster the fixed step runs inside the budget (an OOM would raise); under torchrun nothing caps
    the memory (the cap is set once per process, when its group is made), so both peaks are measured and
    compared."""
    config = p.config()
    per_rank = p.global_batch // w.world_size
    micro, estimated = fixed_micro_batch(p, Machine.resolve(w.cluster, w.world_size))
    counting, limited = w.cluster, w.cluster
    if w.emulated:  # a budget too large to hit only counts; the lab's budget enforces
        counting, limited = (
            replace(w.cluster, memory_gib=1024),
            replace(w.cluster, memory_gib=p.memory_mib / 1024),
        )
    before = w.launch(
        dp_train,
        config,
        p.global_batch,
        per_rank,
        bucket_cap_mb=p.bucket_cap_mb,
        timeout_s=p.timeout_s,
        cluster=counting,
        alike=True,  # data-parallel ranks: one process stands for them on a simulated node
    )
    after = w.launch(
        dp_train,
        config,
        p.global_batch,
        micro,
        precision="autocast",
        checkpointing=True,
        bucket_cap_mb=p.bucket_cap_mb,
        timeout_s=p.timeout_s,
        cluster=limited,
        alike=True,
    )
    before_mib, after_mib = max(r.peak_mib for r in before), max(r.peak_mib for r in after)
    return LabRecords(
        before_mib,
        after_mib,
        float(p.memory_mib),
        "MiB",
        Meaning(
            before="peak memory per rank of the step as first written (the whole per-rank batch, fp32)",
            after=f"peak with micro-batch {micro} under no_sync accumulation, bf16 autocast, checkpointing",
            limit="the memory each rank has" + ("" if w.emulated else " (compared here, not enforced)"),
        ),
        f"peak memory per rank at global batch {p.global_batch}: as first written vs with the fixes",
        {
            "micro_batch_after": micro,
            "estimate_after_mib": estimated.peak / _MIB,
            "peak_source": after[0].peak_source,
            "allreduces_per_step": after[0].allreduce_calls,
            "ddp_buckets": after[0].buckets,
            "fits": after_mib <= p.memory_mib < before_mib,
            # on a simulated machine labkit's OverlappedDDP stands in for torch DDP (whose C++ reducer needs
            # storage): its flat bucket buffers are a second copy of the gradients, which DDP's
            # gradient_as_bucket_view avoids
            "grad_sync": "overlapped" if w.simulated else "ddp",
        },
    )


if __name__ == "__main__":
    main(__spec__.name)
