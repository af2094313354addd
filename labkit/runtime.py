"""Inside a rank: its device, its cluster, its process group, its timer and its memory stats.

This is the one place that decides whether a rank computes on a real GPU or on the
emulated cluster (`on_gpu`); every other module asks it instead of looking at backends,
tensors or CUDA state. `labkit.launch` starts the ranks and calls `init_process_group`
on each; the experiment drivers (`labkit.experiments`), the bandwidth test and the trace
capture read `device()`, `clock()` and the memory functions here.

Outside `labkit.launch` (a plain script, torchrun) a rank is on a GPU when CUDA is there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from labkit import emulate
from labkit.cluster import Cluster

__all__ = [
    "CLUSTER_ENV",
    "cap_above_baseline",
    "clock",
    "current_cluster",
    "device",
    "gpu_baseline_bytes",
    "init_process_group",
    "max_memory_allocated",
    "memory_allocated",
    "on_gpu",
    "on_virtual_clock",
    "peak_bytes",
    "reset_peak_memory_stats",
    "share_one_core",
    "synchronize",
]

CLUSTER_ENV = "LABKIT_CLUSTER"


# ------------------------------------------------------------- where am I


def current_cluster() -> Cluster | None:
    """The cluster this rank was launched on (None outside `labkit.launch`)."""
    return _cluster(os.environ.get(CLUSTER_ENV))


@functools.lru_cache(maxsize=4)
def _cluster(raw: str | None) -> Cluster | None:
    return Cluster.from_json(raw) if raw else None


def on_virtual_clock() -> bool:
    """Is this rank timed on its virtual device clock (an emulated cluster with clock="virtual")?"""
    cluster = current_cluster()
    return cluster is not None and cluster.is_emulated and cluster.clock == "virtual"


def on_gpu() -> bool:
    """Does this rank compute on a CUDA device? No on the emulated cluster, even on a GPU machine."""
    cluster = current_cluster()
    return torch.cuda.is_available() and (cluster is None or not cluster.is_emulated)


def device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` on a GPU cluster, else the CPU."""
    if on_gpu():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# ------------------------------------------------------------------ timer


def synchronize() -> None:
    """Wait until this rank's device has finished its queued work (a no-op on the CPU)."""
    if on_gpu() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def clock() -> float:
    """Seconds on this rank's timer; take differences of two readings.

    On the emulated cluster, by default, the rank's virtual device clock
    (`labkit.emulate.clock`): the time its emulated GPU would show, the same on a busy
    machine. On GPUs (and on an emulated cluster with clock="wall") the wall clock, read
    after the device has finished its queued work (kernels run asynchronously).
    """
    if on_virtual_clock():
        return emulate.rank_clock().now()
    synchronize()
    return time.perf_counter()


# ---------------------------------------------------------- process group


def init_process_group(
    cluster: Cluster, rank: int, world_size: int, store: dist.Store, timeout: timedelta
) -> None:
    """The default group of one launched rank: NCCL on a GPU cluster, the emulated backend else.

    On the virtual clock each emulated GPU computes on one intra-op thread (its clock is that
    thread's CPU time); on the wall clock it gets its share of the cores, as each real GPU is
    its own device. On a GPU with `cluster.memory_gib`, the CUDA allocator's cap is set that much above
    what the warm process holds (`cap_above_baseline`).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cluster.is_emulated:
        threads = 1 if cluster.clock == "virtual" else max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(threads)
        if cluster.clock == "virtual":
            _pin_to_one_core(rank)
            _keep_freed_memory()
        backend, extra = emulate.register_backend(), {}
    else:
        torch.cuda.set_device(local_rank)
        if cluster.memory_gib:
            cap_above_baseline(local_rank, cluster.memory_gib)
        backend, extra = "nccl", {"device_id": torch.device("cuda", local_rank)}
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **extra,
    )


_BASELINE_ENV = "LABKIT_GPU_BASELINE_BYTES"  # this rank's allocated bytes once warm, read by the memory stats


def _warm_up_cuda(dev: torch.device) -> None:
    """One small matmul forward and backward: cuBLAS makes its handle and workspace for this thread and for
    autograd's device thread, which runs the backward (32 MiB each on Hopper), from the caching allocator."""
    a = torch.randn(64, 64, device=dev, requires_grad=True)
    (a @ a).sum().backward()
    torch.cuda.synchronize(dev)


def cap_above_baseline(local_rank: int, memory_gib: float) -> int:
    """Cap this rank's CUDA memory `memory_gib` above what the process holds once warm; return that baseline.

    `set_per_process_memory_fraction` caps *reserved* memory, and the CUDA context's allocations and cuBLAS's
    workspaces come from the same allocator, in blocks rounded to 2 or 20 MiB: a cap of 48 MiB from zero would
    OOM on the workspaces, not on the activations. So: warm up, measure, cap above it; the memory stats below
    report peaks net of the baseline's allocated bytes.
    """
    dev = torch.device("cuda", local_rank)
    _warm_up_cuda(dev)
    total = torch.cuda.get_device_properties(local_rank).total_memory
    reserved = torch.cuda.memory_reserved(dev)
    torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved + memory_gib * 2**30) / total), dev)
    baseline = torch.cuda.memory_allocated(dev)
    os.environ[_BASELINE_ENV] = str(baseline)
    return baseline


def gpu_baseline_bytes() -> int:
    """What this rank held on its GPU when its memory cap was set (0 without a cap, and on the CPU)."""
    return int(os.environ.get(_BASELINE_ENV, "0"))


def _pin_to_one_core(rank: int) -> None:
    """Keep this rank (and the gloo threads it starts next) on one of the cores it may use.

    The virtual clock counts CPU time, and a process that migrates between cores pays for
    the cold caches in CPU time: unpinned, lab 03's compute-alone step measured 131-192 ms
    over four launches on 2 cores; pinned, 134-138 ms. Ranks share cores round-robin.
    """
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if cores:
            os.sched_setaffinity(0, {cores[rank % len(cores)]})


def share_one_core() -> bool:
    """Move this emulated rank onto the first core of the job (every rank that calls it shares that core).

    The virtual clock counts each rank's CPU time on its own core, and two cores of a shared host do not
    always run at the same speed: after minutes at full load this machine's two cores ran 1.3-1.6x apart for
    tens of seconds, enough to hide a rank doing twice the work or to fake one. Ranks that must be compared
    with each other (lab 05's straggler) can share one core instead; each still counts only its own CPU time,
    so virtual times stay per rank, and only the wall time grows. Returns whether it moved (not on GPUs,
    not off the virtual clock, not where affinity cannot be set).
    """
    if not on_virtual_clock() or not hasattr(os, "sched_setaffinity"):
        return False
    # The rank was pinned to one core at start; the process that started it (the launcher's fork
    # server) still has the job's whole set of cores.
    cores = sorted(os.sched_getaffinity(os.getppid()))
    if not cores:
        return False
    os.sched_setaffinity(0, {cores[0]})
    return True


# glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)


def _keep_freed_memory() -> None:
    """Let this rank's malloc keep freed tensor memory for reuse, as CUDA's caching allocator does.

    By default glibc serves large tensors with mmap and hands them back on free, so every
    step page-faults its activations in again (~1,000 faults per lab 03 step), and the
    kernel's page zeroing counts as the rank's CPU time: its virtual clock then drifts with
    memory pressure from other processes. With these two settings the faults drop to ~0 and
    lab 03's compute step from 134-139 to 129-133 ms (CPU time, 10 steps). Not glibc: no-op.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------- memory


def _cuda(dev: torch.device | str | None) -> bool:
    return torch.device(dev).type == "cuda" if dev is not None else on_gpu()


def memory_allocated(device: torch.device | str | None = None) -> int:
    """Bytes in live tensors: CUDA's allocator on a GPU (net of `gpu_baseline_bytes`), the emulated budget on
    the CPU (0 without one)."""
    if _cuda(device):
        return max(0, torch.cuda.memory_allocated(device) - gpu_baseline_bytes())
    budget = emulate.active_budget()
    return budget.allocated if budget is not None else 0


def max_memory_allocated(device: torch.device | str | None = None) -> int:
    """Peak bytes in live tensors since the last `reset_peak_memory_stats`."""
    if _cuda(device):
        return max(0, torch.cuda.max_memory_allocated(device) - gpu_baseline_bytes())
    budget = emulate.active_budget()
    return budget.peak if budget is not None else 0


def reset_peak_memory_stats(device: torch.device | str | None = None) -> None:
    """Start a new peak at the bytes in use now."""
    if _cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return
    budget = emulate.active_budget()
    if budget is not None:
        budget.reset_peak()


def peak_bytes() -> tuple[int, str] | None:
    """(peak bytes since the last reset, what measured it) on this rank; None when nothing
    tracks memory here (the CPU without an emulated budget: use `labkit.measure`)."""
    if on_gpu():
        source = "torch.cuda.max_memory_allocated" + (
            ", net of the warm baseline" if gpu_baseline_bytes() else ""
        )
        return max_memory_allocated(device()), source
    budget = emulate.active_budget()
    return (budget.peak, "emulated budget") if budget is not None else None
