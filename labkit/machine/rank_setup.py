"""A rank's process group and device, made once at its start: for the ranks `labkit.launch` starts
(`init_launched_rank`) and for those torchrun starts (`init_torchrun_rank`).

* On the emulated cluster: the "labkit_emulated" backend (gloo under the α-β link model); on the virtual
  clock one intra-op thread per rank, the rank pinned to a core and malloc keeping freed memory, as CUDA's
  caching allocator does (each measured below).
* On GPUs: the rank's device set, its warm baseline recorded (`labkit.machine.device_memory.record_baseline`,
  capped or not), then a memory cap above it when the cluster has `memory_gib`; NCCL bound to the device.
  Under torchrun the group is "cpu:gloo,cuda:nccl" (CPU tensors over gloo, CUDA tensors over NCCL) after
  checking that the node has a GPU for every local rank, with NCCL's flight recorder dumping into
  `./nccl_dumps/` (`labkit.machine.flight_recorder`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.cluster import Cluster
from labkit.machine import device_memory, emulate, flight_recorder, runtime
from labkit.machine.emulate import fake_cuda

__all__ = ["init_launched_rank", "init_torchrun_rank"]


def init_launched_rank(
    cluster: Cluster, rank: int, world_size: int, store: dist.Store, timeout: timedelta
) -> None:
    """The default group of a rank `labkit.launch` started: NCCL on a GPU cluster, the emulated backend else.

    On the virtual clock each emulated GPU computes on one intra-op thread (its clock is that thread's CPU
    time); on the wall clock it gets its share of the cores, as each real GPU is its own device.
    """
    _freeze_what_is_imported()
    if runtime.on_virtual_clock():
        torch.set_num_threads(1)
        runtime.pin_to_one_core(rank)
        _keep_freed_memory()
    elif cluster.is_emulated:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if cluster.is_emulated:
        backend, extra = emulate.register_backend(), {}
    elif fake_cuda.active():  # CI's fake CUDA: a GPU rank's set-up, collectives on the emulated backend
        _gpu_device(cluster.memory_gib)
        backend, extra = emulate.register_backend(), {}
    else:
        dev = _gpu_device(cluster.memory_gib)
        backend, extra = "nccl", {"device_id": dev}
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **extra,
    )


def init_torchrun_rank(timeout: timedelta, memory_gib: float | None = None) -> bool:
    """Initialise the default group of a torchrun-started rank if it has none; True if created here."""
    if dist.is_initialized():
        return False
    if not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    gpus = torch.cuda.device_count()
    if local_world > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(
            f"torchrun started {local_world} processes on this node, which has {gpus} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible}): one process per GPU, so --nproc-per-node {gpus}"
        )
    dev = _gpu_device(memory_gib)
    # The flight recorder, read at the group's creation: a hang leaves dumps (python -m
    # labkit.machine.flight_recorder)
    env = flight_recorder.env_for(Path.cwd() / "nccl_dumps")
    if flight_recorder.dump_prefix(dict(os.environ)) is None:
        (Path.cwd() / "nccl_dumps").mkdir(
            exist_ok=True
        )  # the writer opens <prefix><rank>, it makes no folder
    else:  # the user's or the site's own place (either name) is kept: the first one set wins
        env = {k: v for k, v in env.items() if k not in flight_recorder.DUMP_VARS}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=dev)
    return True


def _freeze_what_is_imported() -> None:
    """Leave every object the rank starts with (torch's and labkit's modules, hundreds of thousands of them)
    out of the garbage collector's passes from now on (`gc.freeze`).

    A full collection visits every tracked object, and the searches of lab 02 and the simulated runs of
    `published_runs` collect before each trial so that its peak counts that trial alone: in a simulated rank
    that had imported torch those collections took a fifth of the rank's time (py-spy, Table 1's 18.4B row on
    8 ranks). Objects made after this are collected as before.
    """
    gc.freeze()


def _gpu_device(memory_gib: float | None) -> torch.device:
    """Set this rank's GPU, record its warm baseline and, with `memory_gib`, cap it that much above."""
    dev = runtime.device()  # cuda:local_rank (the CPU on CI's fake CUDA machine)
    torch.cuda.set_device(dev)
    device_memory.record_baseline(dev)
    if memory_gib:
        device_memory.cap_above_baseline(dev, memory_gib)
    return dev


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
