"""Lab 02's driver: data-parallel steps with gradient accumulation under DDP, and their memory.

Run on a launched rank (``labkit.launch``), under the rank's memory limit (the emulated
budget or a GPU's memory fraction):

* ``dp_train``: optimizer steps of one global batch each, through ``accumulate(ddp, batches)``
  (``labkit.parallel.data.accumulate_with_no_sync`` by default), counting DDP's all-reduces
  and measuring the peak of the last step;
* ``max_micro_batch``: ``labkit.find_max_batch`` for one rank's training step;
* ``rank_micro_batches`` and ``reference_gradients``: the data split and the single-process
  big-batch gradient the accumulation is checked against (``labkit.experiments.common``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import runtime, validate
from labkit.batch import accumulation_steps
from labkit.experiments.common import CountingAllReduce, rank_rows, reference_backward, seeded_model
from labkit.experiments.script import Where, run_lab
from labkit.measured_memory import BatchSearch, find_max_batch, free_memory, measure
from labkit.memory import MemoryBreakdown, estimate
from labkit.models import GPT, GPTConfig, synthetic_batch
from labkit.parallel.data import accumulate_with_no_sync

__all__ = [
    "DEFAULTS",
    "DPResult",
    "dp_train",
    "headline",
    "main",
    "max_micro_batch",
    "rank_micro_batches",
    "reference_gradients",
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

    Rank r takes its rows of the global batch (``labkit.experiments.common.rank_rows``) and
    cuts them into ``micro_batch`` rows each. Any split of the same global batch therefore
    sees the same samples, so its gradient can be compared with ``reference_gradients``.
    """
    steps = accumulation_steps(global_batch, micro_batch, world_size)
    x, y = rank_rows(config, global_batch, rank, world_size, step=step, seed=seed, device=device)
    return [
        (x[i * micro_batch : (i + 1) * micro_batch], y[i * micro_batch : (i + 1) * micro_batch])
        for i in range(steps)
    ]


class _Runner(nn.Module):
    """The model as DDP sees it: forward under bf16 ``torch.autocast`` if asked (backward then
    runs outside it, as the autocast docs advise), and each loss value logged."""

    def __init__(self, model: nn.Module, device_type: str, autocast: bool) -> None:
        super().__init__()
        self.model = model
        self.device_type = device_type
        self.autocast = autocast
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(x, y)
        self.losses.append(float(loss.detach()))
        return loss


_DP_PRECISIONS = ("fp32", "autocast")


def _lab_model(
    config: GPTConfig, precision: str, checkpointing: bool, seed: int, device: torch.device
) -> tuple[GPT, _Runner]:
    validate.one_of("precision", precision, _DP_PRECISIONS, "'autocast' (bf16 autocast) or 'fp32'")
    model = seeded_model(config, seed, device, checkpointing=checkpointing)
    return model, _Runner(model, device.type, precision == "autocast")


def _host_flat(tensors: list[torch.Tensor]) -> Any:
    """One flat numpy copy of ``tensors`` in host memory, which the device budget does not
    count (``.cpu()`` copies on a GPU; on CPU numpy copies outside torch's dispatcher, and no
    tensor is made from it here: ``torch.from_numpy`` under the emulated budget is counted)."""
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
    peak_source: str  # "emulated budget", "torch.cuda.max_memory_allocated" or "MemTracker"
    allreduce_calls: int  # bucket all-reduces DDP issued in the last optimizer step
    buckets: int  # DDP's buckets (distinct bucket indices seen in that step)
    allreduce_bytes: int  # bytes of gradient buckets all-reduced in that step
    step_s: float  # wall time of the last optimizer step (MemTracker slows it when used)
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

    Each optimizer step processes one global batch: ``micro_batch`` samples x
    ``accumulation_steps(...)`` micro-steps x world_size ranks, through
    ``accumulate(ddp, batches)`` (default ``accumulate_with_no_sync``), then Adam.
    DDP uses ``gradient_as_bucket_view=True`` (gradients live in DDP's buckets, no second
    copy; PyTorch DDP docs) and ``zero_grad(set_to_none=False)``: with ``set_to_none=True``
    the gradients of micro-steps under ``no_sync`` are new tensors next to the buckets
    (measured: +1 gradient copy, 57.1 instead of 53.5 MiB on a 3.6 MiB-gradient model).
    A comm hook counts DDP's bucket all-reduces. Step 1 creates Adam's states and lets DDP
    rebuild its buckets in gradient order (torch 2.13 puts all parameters in one bucket for
    the first step), so the counts and the peak come from the last step. ``breakdown`` runs
    that step under ``measure`` (MemTracker); ``return_grads`` returns step 1's gradients
    (before any update), flattened in parameter order, as a host copy.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        raise ValueError("dp_train runs on a rank: call it as labkit.launch(dp_train, config, ...)")
    validate.positive_int("optimizer_steps", optimizer_steps, "dp_train(config, 64, 16, optimizer_steps=2)")
    validate.positive_number("bucket_cap_mb", bucket_cap_mb, "1.0, or DDP's default 25")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    steps = accumulation_steps(global_batch, micro_batch, world_size)
    accumulate = accumulate_with_no_sync if accumulate is None else accumulate
    # Several runs can share a rank (e.g. one launch comparing options): let the collector
    # free what earlier ones left in reference cycles, so the peak counts this run only.
    free_memory()
    device = runtime.device()
    model, runner = _lab_model(config, precision, checkpointing, seed, device)
    ddp = DDP(runner, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)
    counter = CountingAllReduce()
    ddp.register_comm_hook(counter, CountingAllReduce.hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    grads: Any = None  # numpy copy of the first step's gradients
    losses: list[float] = []  # mean loss of this rank's share of each global batch

    def one_step(step: int) -> None:
        nonlocal grads
        batches = rank_micro_batches(
            config, global_batch, micro_batch, rank, world_size, step=step, seed=seed, device=device
        )
        runner.losses.clear()
        accumulate(ddp, batches)
        if len(runner.losses) != steps:
            raise ValueError(
                f"accumulate ran {len(runner.losses)} forward passes for {steps} micro-batches; "
                f"call ddp(x, y) once for every (x, y) in batches"
            )
        losses.append(sum(runner.losses) / steps)
        if return_grads and step == 0:
            grads = _first_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for step in range(optimizer_steps - 1):
        one_step(step)
    counter.clear()
    peak, source, step_s, measured = _measure_step(
        lambda: one_step(optimizer_steps - 1), model, optimizer, breakdown
    )
    return DPResult(
        rank=rank,
        world_size=world_size,
        global_batch=global_batch,
        micro_batch=micro_batch,
        accumulation_steps=steps,
        precision=precision,
        checkpointing=checkpointing,
        peak_bytes=peak,
        peak_source=source,
        allreduce_calls=len(counter.calls),
        buckets=len({index for index, _ in counter.calls}),
        allreduce_bytes=sum(nbytes for _, nbytes in counter.calls),
        step_s=step_s,
        loss=losses[-1],
        grads_array=grads,
        breakdown=measured if breakdown else None,
    )


def _first_gradients(model: nn.Module) -> Any:
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    if missing:
        raise ValueError(f"no gradient for {missing[:3]}...: did accumulate call backward()?")
    return _host_flat([p.grad for p in model.parameters()])


def _measure_step(
    step: Callable[[], None], model: nn.Module, optimizer: torch.optim.Optimizer, breakdown: bool
) -> tuple[int, str, float, MemoryBreakdown | None]:
    """Run one step; (peak bytes, what measured it, wall seconds, MemTracker breakdown or None).

    The peak comes from the rank's device (CUDA or the emulated budget, `labkit.runtime`);
    where nothing tracks memory, or a breakdown is asked for, the step runs under `measure`.
    """
    runtime.reset_peak_memory_stats()
    tracked = runtime.peak_bytes() is not None
    t0 = time.perf_counter()
    measured = measure(step, model, optimizer, warmup=False) if breakdown or not tracked else None
    if measured is None:
        step()
    step_s = time.perf_counter() - t0
    if tracked:
        peak, source = runtime.peak_bytes()
        return int(peak), source, step_s, measured
    return int(measured.peak), "MemTracker", step_s, measured


def max_micro_batch(
    config: GPTConfig,
    *,
    precision: str = "fp32",
    checkpointing: bool = False,
    start: int = 1,
    limit: int = 4096,
    seed: int = 0,
) -> BatchSearch:
    """``find_max_batch`` for one rank's training step of ``GPT(config)`` on this device.

    Run it where the memory limit is (``labkit.launch`` on a cluster with ``memory_gib``:
    the emulated budget, or the GPU with its memory fraction). The trial step is a plain
    (non-DDP) step with Adam and ``zero_grad(set_to_none=False)``: the same bytes as a
    ``dp_train`` rank, whose gradients live in DDP's buckets for the whole step (both match
    ``estimate(..., keep_grads=True)`` in the tests). Trials do not communicate, so an OOM on
    one rank never leaves another waiting in a collective (a DDP step failing mid-backward
    could).
    """
    free_memory()  # what earlier runs on this rank left in reference cycles
    device = runtime.device()
    model, runner = _lab_model(config, precision, checkpointing, seed, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(batch: int) -> None:
        try:
            x, y = synthetic_batch(config, batch, seed=seed, device=device)
            runner(x, y).backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=False)

    return find_max_batch(step, start=start, limit=limit)


def reference_gradients(config: GPTConfig, global_batch: int, *, seed: int = 0) -> torch.Tensor:
    """Gradient of the mean loss over the whole first global batch, in one process, fp32.

    The big-batch gradient that gradient accumulation must reproduce: same initial weights
    (``torch.manual_seed(seed)``) and same samples as ``dp_train``'s first step, flattened
    in parameter order. Runs on CPU with no memory budget.
    """
    validate.positive_int("global_batch", global_batch)
    model = seeded_model(config, seed)
    reference_backward(model, config, global_batch, step=0, seed=seed)
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])


# ----------------------------------------------------------------- as a script (labkit.experiments.script)

DEFAULTS: dict[str, Any] = {
    "world_size": 2,
    "memory_mib": 28,
    "global_batch": 64,
    "n_layers": 4,
    "d_model": 128,
    "n_heads": 4,
    "vocab_size": 512,
    "seq_len": 64,
    "bucket_cap_mb": 1.0,
    "timeout_s": 120,
}


def headline(
    w: Where,
    memory_mib: float,
    global_batch: int,
    n_layers: int,
    d_model: int,
    n_heads: int,
    vocab_size: int,
    seq_len: int,
    bucket_cap_mb: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Lab 02's records: peak memory per rank of the step as first written and with the fixes, against the memory.

    The fixed step: bf16 autocast and activation checkpointing at the largest micro-batch whose estimate
    (`labkit.memory.estimate`) fits `memory_mib`, accumulated under `no_sync` to the same global batch. On the
    emulated cluster the fixed step runs inside the budget (an OOM would raise); under torchrun nothing caps the
    memory (the cap is set once per process, when its group is made), so both peaks are measured and compared.
    """
    config = GPTConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=vocab_size, seq_len=seq_len
    )
    per_rank = global_batch // w.world_size
    accumulation_steps(
        global_batch, per_rank, w.world_size
    )  # a ValueError with the fix if the batch does not split
    estimates = {
        m: estimate(model=config, precision="autocast", checkpointing=True, micro_batch=m, keep_grads=True)
        for m in range(per_rank, 0, -1)
        if per_rank % m == 0
    }  # largest first
    micro = next((m for m, e in estimates.items() if e.peak <= memory_mib * _MIB), None)
    if micro is None:
        raise ValueError(
            f"not even a micro-batch of 1 fits memory_mib={memory_mib} with autocast and checkpointing; "
            "raise --set memory_mib or shrink the model (--set n_layers 2)"
        )
    counting, limited = w.cluster, w.cluster
    if w.emulated:  # a budget too large to hit only counts; the lab's budget enforces
        counting, limited = (
            replace(w.cluster, memory_gib=1024),
            replace(w.cluster, memory_gib=memory_mib / 1024),
        )
    before = w.launch(
        dp_train,
        config,
        global_batch,
        per_rank,
        bucket_cap_mb=bucket_cap_mb,
        timeout_s=timeout_s,
        cluster=counting,
    )
    after = w.launch(
        dp_train,
        config,
        global_batch,
        micro,
        precision="autocast",
        checkpointing=True,
        bucket_cap_mb=bucket_cap_mb,
        timeout_s=timeout_s,
        cluster=limited,
    )
    before_mib, after_mib = max(r.peak_mib for r in before), max(r.peak_mib for r in after)
    return {
        "before": before_mib,
        "after": after_mib,
        "limit": float(memory_mib),
        "unit": "MiB",
        "meaning": {
            "before": "peak memory per rank of the step as first written (the whole per-rank batch, fp32)",
            "after": f"peak with micro-batch {micro} under no_sync accumulation, bf16 autocast, checkpointing",
            "limit": "the memory each rank has" + ("" if w.emulated else " (compared here, not enforced)"),
        },
        "metric": f"peak memory per rank at global batch {global_batch}: as first written vs with the fixes",
        "micro_batch_after": micro,
        "estimate_after_mib": estimates[micro].peak / _MIB,
        "peak_source": after[0].peak_source,
        "allreduces_per_step": after[0].allreduce_calls,
        "ddp_buckets": after[0].buckets,
        "fits": after_mib <= memory_mib < before_mib,
    }


def main(argv: list[str] | None = None) -> int:
    return run_lab("02_oom_batch", headline, DEFAULTS, argv)


if __name__ == "__main__":
    from labkit.experiments import oom_batch  # by its own name, so launch pickles its functions by reference

    raise SystemExit(oom_batch.main())
