"""Lab 03's driver: time data-parallel steps the naive way, the overlapped way and torch DDP's way.

`train_steps` runs on every rank (launch it with `labkit.launch`): each mode trains its own
copy of the same seeded GPT with SGD, step by step, next to compute alone and
communication alone, and every step is checked against a single-process run on the whole
batch (`labkit.experiments.common`). `summarize_steps` combines the ranks' results.
What a mode does in one step is a function in the `MODES` table below.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from labkit import emulate, runtime, validate
from labkit.experiments.common import (
    CountingAllReduce,
    max_abs_diff,
    rank_rows,
    reference_backward,
    seeded_model,
)
from labkit.experiments.script import Where, run_lab
from labkit.models import GPTConfig
from labkit.parallel.data import OverlappedDDP, allreduce_gradients_naive
from labkit.trace.capture import capture
from labkit.trace.commlog import CommLog
from labkit.trace.device import device_trace_path, write_device_trace

__all__ = ["DEFAULTS", "MODES", "TRAIN_MODES", "Mode", "headline", "main", "summarize_steps", "train_steps"]


@dataclass
class _Run:
    """One mode's private copy of the model, its optimizer and what its last step counted."""

    module: nn.Module
    opt: torch.optim.Optimizer
    group: dist.ProcessGroup | None
    wrapped: nn.Module
    log: CommLog = field(default_factory=CommLog)
    counter: CountingAllReduce | None = None  # torch DDP's comm hook
    collectives: int = 0  # in the last step
    in_backward: int | None = None  # collectives launched before backward() returned


# ---------------------------------------------------------------- one step per mode


def _train(run: _Run, x: torch.Tensor, y: torch.Tensor, sync: Callable[[_Run], None] | None = None) -> None:
    """Forward, backward, gradient synchronisation (if any), optimizer step."""
    run.opt.zero_grad()
    with record_function("forward"):
        loss = run.wrapped(x, y)
    if run.counter is not None:
        run.counter.clear()
        run.counter.backward_running = True
    with record_function("backward"):
        loss.backward()
    if run.counter is not None:
        run.counter.backward_running = False
        run.collectives, run.in_backward = len(run.counter.calls), run.counter.in_backward
    if sync is not None:
        sync(run)
    with record_function("optimizer.step"):
        run.opt.step()


def _naive_sync(run: _Run) -> None:
    run.collectives = allreduce_gradients_naive(run.module, run.group, comm_log=run.log)


def _naive_step(run: _Run, x: torch.Tensor, y: torch.Tensor) -> None:
    _train(run, x, y, _naive_sync)
    run.in_backward = 0  # by construction: it all-reduces after backward


def _overlapped_sync(run: _Run) -> None:
    run.wrapped.finish_gradient_synchronization()
    run.collectives = run.wrapped.num_collectives


def _overlapped_step(run: _Run, x: torch.Tensor, y: torch.Tensor) -> None:
    _train(run, x, y, _overlapped_sync)
    run.in_backward = run.wrapped.launched_in_backward


# ------------------------------------------------------ how each mode wraps the model


def _bare(run: _Run, bucket_cap_mb: float, ddp_class: type) -> None:
    pass


def _overlapped(run: _Run, bucket_cap_mb: float, ddp_class: type) -> None:
    run.wrapped = ddp_class(run.module, bucket_cap_mb=bucket_cap_mb, process_group=run.group)
    run.wrapped.comm_log = run.log


def _torch_ddp(run: _Run, bucket_cap_mb: float, ddp_class: type) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dev = runtime.device()
    run.wrapped = DistributedDataParallel(
        run.module,
        device_ids=[dev.index] if dev.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        process_group=run.group,
    )
    run.counter = CountingAllReduce(run.group, log=run.log)
    run.wrapped.register_comm_hook(run.counter, CountingAllReduce.hook)


def _grads_only(wrap: Callable) -> Callable:
    """The same wrapper, with zero gradients to send and no compute (communication alone)."""

    def wrap_with_grads(run: _Run, bucket_cap_mb: float, ddp_class: type) -> None:
        wrap(run, bucket_cap_mb, ddp_class)
        for p in run.module.parameters():
            p.grad = torch.zeros_like(p)

    return wrap_with_grads


@dataclass(frozen=True)
class Mode:
    """One way of doing a data-parallel step: how the model is wrapped, and what one step does."""

    wrap: Callable[[_Run, float, type], None]
    step: Callable[[_Run, torch.Tensor, torch.Tensor], None]
    trains: bool  # updates the model data-parallel, so it is checked against the reference


MODES: dict[str, Mode] = {
    "compute": Mode(_bare, lambda run, x, y: _train(run, x, y), trains=False),
    "comm_naive": Mode(_grads_only(_bare), lambda run, x, y: _naive_sync(run), trains=False),
    "naive": Mode(_bare, _naive_step, trains=True),
    "comm_overlapped": Mode(_grads_only(_overlapped), lambda run, x, y: _overlapped_sync(run), trains=False),
    "overlapped": Mode(_overlapped, _overlapped_step, trains=True),
    "torch_ddp": Mode(_torch_ddp, lambda run, x, y: _train(run, x, y), trains=True),  # DDP's hooks, counted
}
TRAIN_MODES = tuple(MODES)


def _make_run(
    mode: str,
    model: nn.Module,
    lr: float,
    bucket_cap_mb: float,
    ddp_class: type,
    group: dist.ProcessGroup | None,
) -> _Run:
    run = _Run(model, torch.optim.SGD(model.parameters(), lr=lr), group, wrapped=model)
    MODES[mode].wrap(run, bucket_cap_mb, ddp_class)
    return run


# ---------------------------------------------------------------------- the driver


def _check_modes(modes: Sequence[str], trace_modes: Sequence[str], steps: int, warmup: int) -> None:
    bad = [m for m in list(modes) + list(trace_modes) if m not in MODES]
    if bad:
        raise ValueError(f"train_steps: unknown mode(s) {bad}; choose from {list(TRAIN_MODES)}.")
    missing = [m for m in trace_modes if m not in modes]
    if missing:
        raise ValueError(f"train_steps: trace_modes {missing} must also be in modes={list(modes)}.")
    validate.positive_int("train_steps steps", steps, "train_steps(modes, steps=5)")
    validate.non_negative_int("train_steps warmup", warmup, "train_steps(modes, warmup=1)")


def _waited_s() -> float | None:
    """Seconds this rank's virtual clock has waited for collectives (None off the virtual clock)."""
    return emulate.rank_clock().waited() if runtime.on_virtual_clock() else None


def _timed(
    run: _Run, step_fn: Callable, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float, float, float | None]:
    """(ms, process CPU ms, start, ms waiting for collectives or None) of one step on
    `labkit.runtime.clock`, after a barrier. The CPU time is the host's work on the step only: on a GPU
    `runtime.clock` synchronizes the device, and that wait spins the CPU (CUDA's default), so it is read
    after the first reading of the clock and before the second."""
    dist.barrier(group=run.group)
    w0, t0 = _waited_s(), runtime.clock()
    cpu0 = time.process_time()
    step_fn(run, x, y)
    cpu_ms = (time.process_time() - cpu0) * 1e3
    ms = (runtime.clock() - t0) * 1e3
    return ms, cpu_ms, t0, (_waited_s() - w0) * 1e3 if w0 is not None else None


def train_steps(
    modes: Sequence[str] = ("compute", "naive", "overlapped"),
    config: Any = None,
    batch_size: int = 16,
    *,
    steps: int = 5,
    warmup: int = 1,
    bucket_cap_mb: float = 25.0,
    lr: float = 0.1,
    seed: int = 0,
    check: bool = True,
    ddp_class: type | None = None,
    trace_modes: Sequence[str] = (),
    trace_dir: str | None = None,
    trace_steps: int = 2,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Time data-parallel training steps of a `labkit.models.GPT`, several ways; every rank calls it.

    `modes` (any of TRAIN_MODES), each on its own copy of the same initial model, with SGD:

    * "compute": forward, backward, optimizer step, no communication (compute alone);
    * "naive": the mistake, `allreduce_gradients_naive` after backward;
    * "overlapped": `ddp_class` (default `OverlappedDDP`) with `bucket_cap_mb`;
    * "torch_ddp": torch's DistributedDataParallel with the same `bucket_cap_mb`;
    * "comm_naive" / "comm_overlapped": the collectives of "naive" / "overlapped" (same sizes,
      same count, zero gradients) and nothing else (communication alone).

    The modes are interleaved step by step (all modes do step 1, then step 2, ...), so a
    slow spell of a noisy machine hits them all; a barrier precedes every timed step, and
    the device is synchronised before the clock is read (`labkit.runtime.clock`). Each rank
    trains on its `batch_size` rows of a global batch of `batch_size x world_size`
    (`labkit.experiments.common.rank_rows`). With `check`, every rank also runs a
    single-process reference on the whole global batch and, after every step, records the
    largest absolute parameter difference of each training mode against it. Afterwards,
    the modes in `trace_modes` are profiled for `trace_steps` steps (after one warm-up) with
    `labkit.trace.capture`, one file per mode and rank; on the emulated cluster's virtual clock
    the device timeline of the last `trace_steps` timed steps is written next to each.

    Returns a dict: "modes" maps each mode to {"ms": per-step times after warm-up,
    "cpu_ms": CPU time of the whole process (all threads) per step, "collectives" and
    "in_backward" (collectives launched before backward() returned) per step, "buckets"
    and "bucket_summary" (overlapped modes), "max_abs_diff" (after every step, warm-up
    included; None when not checked)}, plus "traces" {mode: host trace path}, "device_traces"
    {mode: device timeline path} (emulated cluster, virtual clock), "param_tensors",
    "params", "grad_bytes", "rank", "world_size" and "device". Combine the ranks with
    `summarize_steps`.
    """
    _check_modes(modes, trace_modes, steps, warmup)
    config = config if config is not None else GPTConfig()
    ddp_class = ddp_class if ddp_class is not None else OverlappedDDP
    dev = runtime.device()
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    global_batch = batch_size * world

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rank_rows(config, global_batch, rank, world, step=step, seed=seed, device=dev)

    runs = {
        m: _make_run(m, seeded_model(config, seed, dev), lr, bucket_cap_mb, ddp_class, process_group)
        for m in modes
    }
    checked = [m for m in modes if MODES[m].trains] if check else []
    ref = seeded_model(config, seed, dev) if checked else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr) if ref is not None else None
    out = {
        m: {
            "ms": [],
            "cpu_ms": [],
            "waited_ms": [],
            "collectives": [],
            "in_backward": [],
            "buckets": runs[m].wrapped.num_buckets if "overlapped" in m else None,
            "bucket_summary": runs[m].wrapped.bucket_summary() if "overlapped" in m else None,
            "max_abs_diff": [] if m in checked else None,
        }
        for m in modes
    }

    windows: dict[str, list] = {m: [] for m in modes}  # (step, start, end) on runtime.clock
    for s in range(warmup + steps):
        x, y = batch(s)
        for m in modes:
            ms, cpu_ms, t0, waited_ms = _timed(runs[m], MODES[m].step, x, y)
            if s >= warmup:
                windows[m].append((s, t0, t0 + ms / 1e3))
                row = out[m]
                row["ms"].append(ms)
                row["cpu_ms"].append(cpu_ms)
                row["waited_ms"].append(waited_ms)
                row["collectives"].append(runs[m].collectives)
                row["in_backward"].append(runs[m].in_backward)
        if ref is not None:
            reference_backward(ref, config, global_batch, step=s, seed=seed)
            ref_opt.step()
            for m in checked:
                out[m]["max_abs_diff"].append(max_abs_diff(runs[m].module, ref))

    traces, device_traces = {}, {}
    folder = Path(trace_dir) if trace_dir else Path(tempfile.gettempdir()) / "labkit_traces"
    for m in trace_modes:
        run, (x, y) = runs[m], batch(warmup + steps)
        run.log.clear()
        dist.barrier(group=process_group)
        path = capture(
            lambda run=run, x=x, y=y, m=m: MODES[m].step(run, x, y),
            steps=trace_steps,
            warmup=1,
            path=folder / f"{m}_rank{{rank}}.json",
            comm_log=run.log,
            device_trace=False,
        )
        traces[m] = str(path)
        if runtime.on_virtual_clock():  # the device timeline of the timed (unprofiled) steps, in virtual time
            device = write_device_trace(
                device_trace_path(path), emulate.rank_clock(), windows[m][-trace_steps:], rank
            )
            device_traces[m] = str(device)
    dist.barrier(group=process_group)

    params = [p for p in runs[modes[0]].module.parameters() if p.requires_grad]
    return {
        "modes": out,
        "traces": traces,
        "device_traces": device_traces,
        "param_tensors": len(params),
        "params": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "rank": rank,
        "world_size": world,
        "device": str(dev),
    }


def _own_compute_ms(per_rank: list[dict[str, Any]]) -> float | None:
    """Median over steps of the slowest rank's step time less its waits (None without waits)."""
    if any(not pr.get("waited_ms") or None in pr["waited_ms"] for pr in per_rank):
        return None
    own = zip(*([ms - w for ms, w in zip(pr["ms"], pr["waited_ms"])] for pr in per_rank))
    return statistics.median(max(step) for step in own)


def summarize_steps(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Combine `train_steps` results of all ranks: per mode, the median step time (ms).

    A data-parallel step is as slow as its slowest rank, so each step's time is the
    maximum over ranks; the median over steps is then robust to a noisy machine. Also
    gives the step's own compute on the virtual clock ("compute_ms": the step less its waits
    for collectives, slowest rank, median over steps; None elsewhere), the CPU time per step
    (median per rank, mean over ranks), the collectives per
    step, how many were launched during backward, the number of buckets and the worst
    parameter difference against the single-process reference.
    """
    if not results:
        raise ValueError("summarize_steps got no results; pass the list that labkit.launch returned.")
    summary = {}
    for m in results[0]["modes"]:
        per_rank = [r["modes"][m] for r in results]
        step_max = [max(ms) for ms in zip(*(pr["ms"] for pr in per_rank))]
        diffs = [d for pr in per_rank for d in (pr["max_abs_diff"] or [])]
        summary[m] = {
            "ms": statistics.median(step_max),
            "ms_steps": step_max,
            # the step's own compute (its time less the waits for collectives; virtual clock only)
            "compute_ms": _own_compute_ms(per_rank),
            "cpu_ms": statistics.mean(statistics.median(pr["cpu_ms"]) for pr in per_rank),
            "collectives": per_rank[0]["collectives"][-1] if per_rank[0]["collectives"] else 0,
            "in_backward": per_rank[0]["in_backward"][-1] if per_rank[0]["in_backward"] else None,
            "buckets": per_rank[0]["buckets"],
            "max_abs_diff": max(diffs) if diffs else None,
        }
    return summary


# ----------------------------------------------------------------- as a script (labkit.experiments.script)

DEFAULTS: dict[str, Any] = {
    "world_size": 2,
    "n_layers": 6,
    "d_model": 128,
    "seq_len": 64,
    "batch_size": 12,
    "bucket_cap_mb": 0.5,
    "steps": 5,
    "warmup": 1,
    "trace_dir": "traces_03",
    "timeout_s": 120,
}


def headline(
    w: Where,
    n_layers: int,
    d_model: int,
    seq_len: int,
    batch_size: int,
    bucket_cap_mb: float,
    steps: int,
    warmup: int,
    trace_dir: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Lab 03's records: the step with per-tensor all-reduces after backward, with buckets during backward, and
    max(compute, bucketed communication alone) from the same launch; overlap % from the traces."""
    from labkit.trace import overlap, read_trace

    config = GPTConfig(n_layers=n_layers, d_model=d_model, n_heads=4, vocab_size=256, seq_len=seq_len)
    modes = ["compute", "naive", "comm_overlapped", "overlapped"]
    run = w.launch(
        train_steps,
        modes,
        config,
        batch_size,
        steps=steps,
        warmup=warmup,
        bucket_cap_mb=bucket_cap_mb,
        trace_modes=["naive", "overlapped"],
        trace_dir=str(Path(trace_dir).resolve()),
        timeout_s=timeout_s,
    )
    s = summarize_steps(run)
    own = s["overlapped"]["compute_ms"]  # the step less its waits, on the virtual clock; else compute alone
    limit = max(own if own is not None else s["compute"]["ms"], s["comm_overlapped"]["ms"])
    pct = {
        m: statistics.mean(
            overlap(read_trace(r["device_traces"].get(m) or r["traces"][m]))["overlap_pct"] for r in run
        )
        for m in ("naive", "overlapped")
    }
    return {
        "before": s["naive"]["ms"],
        "after": s["overlapped"]["ms"],
        "limit": limit,
        "unit": "ms",
        "meaning": {
            "before": "data-parallel step, every gradient all-reduced after backward (median, slowest rank)",
            "after": f"step with {bucket_cap_mb} MiB buckets all-reduced from gradient hooks during backward",
            "limit": "max(compute, bucketed communication alone), measured in the same launch",
        },
        "metric": "data-parallel step time: per-tensor all-reduce after backward vs buckets during backward",
        "compute_ms": s["compute"]["ms"],
        "own_compute_ms": own,
        "comm_ms": s["comm_overlapped"]["ms"],
        "overlap_pct_before": pct["naive"],
        "overlap_pct_after": pct["overlapped"],
        "collectives_before": s["naive"]["collectives"],
        "collectives_after": s["overlapped"]["collectives"],
        "max_abs_diff": max(s[m]["max_abs_diff"] for m in ("naive", "overlapped")),
        "traces": run[0]["traces"],
    }


def main(argv: list[str] | None = None) -> int:
    return run_lab("03_unoverlapped_comms", headline, DEFAULTS, argv)


if __name__ == "__main__":
    from labkit.experiments import (
        unoverlapped_comms,
    )  # by its own name, so launch pickles its functions by reference

    raise SystemExit(unoverlapped_comms.main())
