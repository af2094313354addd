"""A bandwidth test in the style of nccl-tests: time one collective per size, report bus bandwidth.

`bandwidth_test` is what lab 00 sweeps: every rank calls it, each gets the same rows
(size, median time, algorithm bandwidth and bus bandwidth as nccl-tests defines them,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). The bus-bandwidth
factors and the α-β model the results are compared with live in `labkit.links`; the timer
is `labkit.runtime.clock`.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from labkit import runtime, validate
from labkit.links import bus_bandwidth_factor

__all__ = ["bandwidth_test"]


def _run_collective(
    op: str, full: torch.Tensor, shard: torch.Tensor, src: int, group: dist.ProcessGroup | None
) -> None:
    """One blocking collective; `full` is the nccl-tests "size" buffer, `shard` is full / n."""
    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(full, shard, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full, group=group)
    else:
        dist.broadcast(full, src=src, group=group)


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
    world_size elements). Each row: op, size_bytes, world_size, time_ms (median over
    `iters`), algbw_GBps = size / time and busbw_GBps = algbw · bus_bandwidth_factor(op, n).
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
        for _ in range(warmup):
            _run_collective(op, full, shard, src, process_group)
        times = []
        for _ in range(iters):
            t0 = runtime.clock()
            _run_collective(op, full, shard, src, process_group)
            times.append(runtime.clock() - t0)
        seconds = statistics.median(times)
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
