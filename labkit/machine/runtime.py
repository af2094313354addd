"""Inside a rank: where it runs. Its cluster, whether it computes on a GPU, its device, its cores.

This is the one place that decides whether a rank computes on a real GPU or on the emulated cluster
(`on_gpu`); every other module asks it instead of looking at backends, tensors or CUDA state. Its
neighbours: `labkit.machine.rank_setup` makes the rank's process group, `labkit.machine.timer` times it and
`labkit.machine.device_memory` measures its memory.

Outside `labkit.launch` (a plain script, torchrun) a rank is on a GPU when CUDA is there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch

from labkit.cluster import Cluster
from labkit.machine import _torch_compat as compat
from labkit.machine import emulate
from labkit.machine.emulate import fake_cuda

__all__ = [
    "CLUSTER_ENV",
    "current_cluster",
    "device",
    "on_gpu",
    "on_simulated",
    "on_virtual_clock",
    "optimizer_options",
    "pin_to_one_core",
    "share_one_core",
    "synchronize",
    "value_of",
    "warm_heap",
]

CLUSTER_ENV = "LABKIT_CLUSTER"


def current_cluster() -> Cluster | None:
    """The cluster this rank was launched on (None outside `labkit.launch`)."""
    return _cluster(os.environ.get(CLUSTER_ENV))


@functools.lru_cache(maxsize=4)
def _cluster(raw: str | None) -> Cluster | None:
    return Cluster.from_json(raw) if raw else None


def on_virtual_clock() -> bool:
    """Is this rank timed on its virtual device clock (an emulated cluster with clock="virtual", a simulated
    machine, whose clock's compute is each operator's modelled time, or a launched rank of CI's fake CUDA
    machine, whose collectives run on the emulated backend)?"""
    cluster = current_cluster()
    if cluster is None:
        return False
    if cluster.is_emulated:
        return cluster.clock in ("virtual", "simulated")
    return fake_cuda.active()


def on_simulated() -> bool:
    """Is this rank on a simulated machine (`Cluster.simulated()`: FakeTensors, modelled operator times)?"""
    cluster = current_cluster()
    return cluster is not None and cluster.is_simulated


def clock_counts_cpu_time() -> bool:
    """Does this rank's clock count its own CPU time (the emulated cluster's virtual clock, a launched rank of
    CI's fake CUDA machine), so that the host's page faults and a shared core's speed show in it? Not a
    simulated machine's, whose compute is each operator's modelled time."""
    return on_virtual_clock() and not on_simulated()


def optimizer_options() -> dict[str, bool]:
    """Keyword arguments for a torch optimizer made on this rank: on a GPU (real, fake or simulated), what
    torch picks for CUDA tensors by default (`foreach=True`: one kernel per group of tensors, not a loop over
    them), whose temporaries `labkit.memory.estimate(foreach=True)` counts; nothing elsewhere (torch's own
    default on CPU tensors: a loop)."""
    return {"foreach": True} if on_simulated() or on_gpu() else {}


def value_of(t: torch.Tensor) -> float:
    """A one-element tensor's value, or NaN for a FakeTensor: a simulated machine computes no values."""
    return float("nan") if compat.is_fake(t) else float(t)


def on_gpu() -> bool:
    """Does this rank compute on a CUDA device? No on the emulated cluster, even on a GPU machine."""
    cluster = current_cluster()
    return torch.cuda.is_available() and (cluster is None or not cluster.is_emulated)


def device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` on a GPU cluster, else the CPU (and on CI's fake CUDA machine,
    whose tensors stay on the CPU)."""
    if on_gpu() and not fake_cuda.active():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def synchronize() -> None:
    """Wait until this rank's device has finished its queued work (a simulated GPU's host waits for it; a
    no-op on the CPU)."""
    if on_gpu() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if on_simulated():
        simulated = emulate.active_simulated_device()
        if simulated is not None:
            simulated.synchronize()


def pin_to_one_core(rank: int) -> None:
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
    so virtual times stay per rank, and only the wall time grows. Returns whether it moved: only where the
    clock counts CPU time (`clock_counts_cpu_time`; on a simulated machine sharing a core would only double
    the wall time) and affinity can be set.
    """
    if not clock_counts_cpu_time() or not hasattr(os, "sched_setaffinity"):
        return False
    # The rank was pinned to one core at start; the process that started it (the launcher's fork
    # server) still has the job's whole set of cores.
    cores = sorted(os.sched_getaffinity(os.getppid()))
    if not cores:
        return False
    os.sched_setaffinity(0, {cores[0]})
    return True


def warm_heap(mib: int = 256) -> bool:
    """Page `mib` MiB of this emulated rank's malloc heap in once, before anything on it is measured.

    Ranks compared with each other (lab 05's straggler, lab 06's check) must not differ by who touched fresh
    memory. A page touched for the first time costs a page fault and its zeroing, counted as the rank's CPU
    time (its virtual clock); in a virtual machine that lazily backs guest memory the host's fault lands there
    too. Profiling a step of lab 06's job page-faulted 500-4,900 times per rank (up to 12 ms of system time in
    a 60 ms step), and a clean two-rank job was once taken for a straggler at 1.62x (57.1 vs 35.2 ms) in CI.
    Touched once and freed (`rank_setup` has malloc keep freed memory), the heap serves the steps from pages
    already in: 4-20 faults per step. The job's heap grew by about 150 MiB; 256 MiB cost 130 ms of CPU time
    here, once. Returns whether it ran (the virtual clock and glibc only; not on a simulated machine, whose
    clock counts each operator's modelled time, never the host's page faults).
    """
    if not clock_counts_cpu_time():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return False
    chunk = 4 * 2**20  # below the mmap threshold rank_setup sets (32 MiB): served from the heap, kept on free
    blocks = []
    for _ in range(max(1, mib * 2**20 // chunk)):
        block = libc.malloc(chunk)
        if not block:
            break
        ctypes.memset(block, 0, chunk)
        blocks.append(block)
    for block in blocks:
        libc.free(block)
    return bool(blocks)
