"""A bandwidth test in the style of nccl-tests: time one collective per size, report bus bandwidth.

`bandwidth_test` is what lab 00 sweeps: every rank calls it, each gets the same rows
(size, time per collective, algorithm bandwidth and bus bandwidth as nccl-tests defines them,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). The bus-bandwidth
factors and the α-β model the results are compared with live in `labkit.links`; the timer
is `labkit.machine.timer.clock`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from labkit import validate
from labkit.links import bus_bandwidth_factor
from labkit.machine import runtime, timer

__all__ = ["bandwidth_test"]

# What the host needs to enqueue one collective through c10d (its Python call, ProcessGroupNCCL's
# bookkeeping, the kernel launch): tens of microseconds; 100 us is a generous bound.
ENQUEUE_S = 100e-6


def _start(
    op: str, full: torch.Tensor, shard: torch.Tensor, src: int, group: dist.ProcessGroup | None
) -> Any:
    """Start one asynchronous collective; `full` is the nccl-tests "size" buffer, `shard` is full / n."""
    if op == "all_reduce":
        return dist.all_reduce(full, group=group, async_op=True)
    if op == "all_gather":
        return dist.all_gather_into_tensor(full, shard, group=group, async_op=True)
    if op == "reduce_scatter":
        return dist.reduce_scatter_tensor(shard, full, group=group, async_op=True)
    return dist.broadcast(full, src=src, group=group, async_op=True)


def _run(
    op: str, count: int, full: torch.Tensor, shard: torch.Tensor, src: int, group: dist.ProcessGroup | None
) -> float:
    """Seconds per collective of `count` launched back to back, as nccl-tests times them.

    nccl-tests launches its iterations one after another and waits once at the end, so the
    host's per-call overhead hides behind the transfers and the device's time is measured;
    the buffers hold zeros, so overlapping in-place reductions cannot change them. On a GPU the
    span is read from CUDA events on the current stream: ProcessGroupNCCL makes its stream wait
    for the current one when a collective starts, and `work.wait()` makes the current stream wait
    for the collective's end, so the two events bracket the K collectives on the device.
    An idle GPU would record the start event at once and then wait for the host to enqueue
    each collective, so that up to ~64 KiB the figure would be c10d's per-call overhead, not
    NCCL's latency. A spin kernel queued first keeps the stream busy while the host enqueues
    all K (`ENQUEUE_S` each): the start event then fires with the collectives already queued.
    On the virtual clock (the emulated cluster, CI's fake CUDA machine) the span is read from the
    emulated device's timeline in the same way (`timer.CollectivesSpan`), and the same spin is queued on
    its emulated stream: without it, a host that issues a small message's collectives more slowly than
    the link runs them (a busy machine, a first launch) leaves gaps the span would count as link time.
    """
    timer.occupy_device(1e-3 + count * ENQUEUE_S)  # CUDA events (or the device timeline) bracket the span
    with timer.CollectivesSpan() as span:  # CUDA events on a GPU, the device timeline on the virtual clock
        works = [_start(op, full, shard, src, group) for _ in range(count)]
        for work in works:
            work.wait()
    return span.ms / 1e3 / count


def bandwidth_test(
    sizes_bytes: list[int],
    *,
    op: str = "all_reduce",
    iters: int = 5,
    warmup: int = 1,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """Time a collective at each size, nccl-tests style; every rank calls it, each gets the rows.

    `size_bytes` follows nccl-tests: the buffer of all_reduce and broadcast, the *output* of
    all_gather and the *input* of reduce_scatter (sizes are rounded down to a multiple of
    world_size elements). As in nccl-tests, `warmup` then `iters` collectives are launched
    back to back and waited for at the end, timed on `labkit.machine.timer.clock` (the virtual
    device clock on the emulated cluster). Each row: op, size_bytes, world_size, time_ms (per
    collective), algbw_GBps = size / time and busbw_GBps = algbw · bus_bandwidth_factor(op, n).
    """
    validate.positive_int("iters", iters, "bandwidth_test(sizes, iters=5)")
    validate.non_negative_int("warmup", warmup, "bandwidth_test(sizes, warmup=1)")
    n = dist.get_world_size(process_group)
    factor = bus_bandwidth_factor(op, n)
    device = torch.device(device) if device is not None else runtime.device()
    elem = torch.tensor([], dtype=dtype).element_size()
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    rows = []
    for size in sizes_bytes:
        count = (int(size) // elem // n) * n  # elements, a multiple of n
        if count == 0:
            raise ValueError(
                f"size {size} bytes is smaller than world_size({n}) * {elem}-byte elements; "
                f"use sizes >= {n * elem} bytes."
            )
        full = torch.zeros(count, dtype=dtype, device=device)  # zeros: sums never overflow
        shard = torch.zeros(count // n, dtype=dtype, device=device)
        dist.barrier(group=process_group)
        if warmup:
            _run(op, warmup, full, shard, src, process_group)
        dist.barrier(group=process_group)
        seconds = _run(op, iters, full, shard, src, process_group)
        nbytes = count * elem
        algbw = nbytes / seconds / 1e9
        rows.append(
            {
                "op": op,
                "size_bytes": nbytes,
                "world_size": n,
                "time_ms": seconds * 1e3,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * factor,
            }
        )
    dist.barrier(group=process_group)
    return rows
