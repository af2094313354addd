"""A fake CUDA machine, for CI: `torch.cuda` as a GPU node's Python code sees it, on a CPU build of torch.

CI has no GPU, so the GPU branch of every notebook and driver would never run there. With `$LABKIT_FAKE_CUDA`
set (the number of GPUs, e.g. "8"), `import labkit` calls `install()`, which makes `torch.cuda` say that this
machine has that many H100-sized GPUs and serves its memory API from labkit's model of CUDA's caching
allocator (`labkit.machine.emulate.allocator`, CUDA's rounding and its 2 MiB and 20 MiB segments):

* `is_available`, `device_count`, `get_device_properties`, `get_device_name`, `set_device`, `synchronize`,
  `is_initialized`;
* `memory_allocated`, `max_memory_allocated`, `memory_reserved`, `max_memory_reserved`,
  `reset_peak_memory_stats`, `memory_stats`, `memory_snapshot`, `empty_cache`, `mem_get_info`,
  `set_per_process_memory_fraction` (a cap on reserved bytes, as CUDA's), an OOM as CUDA words it;
* `Event(enable_timing=True)`: a reading of the rank's clock (`labkit.machine.emulate.clock`), as a CUDA
  event on the current stream would be a point on the device's timeline.

Tensors stay on the CPU (torch's CPU build cannot make a CUDA tensor, not even a FakeTensor): a rank's device
on this machine is the CPU (`labkit.machine.runtime.device`), every storage it makes is malloc'ed from the
allocator model, and its collectives run on the emulated backend on the virtual clock, with links scaled to
this CPU as on the emulated cluster (`labkit.cluster.Cluster.detect`), so that a lesson measured in time shows
as it does there. What it cannot check: CUDA kernels, streams, NCCL, real allocator workspaces (cuBLAS, NCCL
buffers).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import torch

from labkit.gpu_links import FAKE_CUDA_SUFFIX
from labkit.machine.emulate.budget import MemoryBudget
from labkit.machine.emulate.clock import CLOCK_ENV, rank_clock

__all__ = ["ENV", "GPU_NAME", "TOTAL_BYTES", "active", "gpus", "install"]

ENV = "LABKIT_FAKE_CUDA"  # the number of fake GPUs; unset or "0": off
GPU_NAME = f"NVIDIA H100 80GB HBM3 {FAKE_CUDA_SUFFIX}"
TOTAL_BYTES = 80 * 2**30

_STATE: dict[str, Any] = {}  # this process's fake: its budget (one per process, as one GPU per rank)


def gpus() -> int:
    """How many GPUs the fake machine has (0: not asked for)."""
    raw = os.environ.get(ENV, "0").strip() or "0"
    try:
        return max(0, int(raw))
    except ValueError as err:
        raise ValueError(f"{ENV}={raw!r} must be a number of GPUs, e.g. {ENV}=2") from err


def active() -> bool:
    """Is this process on the fake CUDA machine (installed here)?"""
    return "budget" in _STATE


def _budget() -> MemoryBudget:
    budget = _STATE.get("budget")
    if budget is None:
        raise RuntimeError(f"the fake CUDA machine is not installed in this process (set {ENV}=2 first)")
    return budget


def _new_budget() -> MemoryBudget:
    budget = MemoryBudget(TOTAL_BYTES, device_name=GPU_NAME, allocator="caching", off_the_clock=True)
    budget.__enter__()  # for the rest of the process: every storage made here is the GPU's
    _STATE["budget"] = budget
    return budget


def _empty_gpu_in_child() -> None:
    """A forked rank starts with an empty GPU, not its parent's: the same budget (it is on the inherited mode
    stack), forgetting what the parent counted."""
    budget = _STATE.get("budget")
    if budget is not None:
        budget.forget()


class _Event:
    """A CUDA event with timing: `record()` reads the rank's clock; `elapsed_time` in milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        virtual = os.environ.get(CLOCK_ENV) in ("virtual", "simulated")  # a launched rank's clock
        self._t = rank_clock().now() if virtual else time.perf_counter()

    def query(self) -> bool:
        return self._t is not None

    def synchronize(self) -> None:
        if self._t is None:
            raise RuntimeError("a CUDA event is synchronized before it was recorded")

    def wait(self, stream: Any = None) -> None:
        return None

    def elapsed_time(self, end: _Event) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._t - self._t) * 1e3


def _properties(device: Any = None) -> SimpleNamespace:
    return SimpleNamespace(
        name=GPU_NAME,
        total_memory=TOTAL_BYTES,
        major=9,
        minor=0,
        multi_processor_count=132,
        is_integrated=False,
    )


def _set_fraction(fraction: float, device: Any = None) -> None:
    """A cap on reserved bytes, as CUDA's (`set_per_process_memory_fraction`)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    allocator = _budget().allocator
    allocator.capacity_bytes = max(1, int(fraction * TOTAL_BYTES))


def _stats(device: Any = None) -> dict[str, int]:
    """The keys of `torch.cuda.memory_stats()` the course and gpu_check read."""
    a = _budget().allocator
    return {
        "allocated_bytes.all.current": a.allocated,
        "allocated_bytes.all.peak": a.peak_allocated,
        "reserved_bytes.all.current": a.reserved,
        "reserved_bytes.all.peak": a.peak_reserved,
        "inactive_split_bytes.all.current": a.inactive_split,
        "active_bytes.all.current": a.allocated,
        "num_ooms": 0,
    }


def _snapshot(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """`torch.cuda.memory_snapshot()`'s segments: address, size, blocks with size and state."""
    out = []
    for seg in _budget().allocator.segments():
        blocks = [
            {"size": size, "state": "active_allocated" if used else "inactive"}
            for _, size, used in seg["blocks"]
        ]
        total = sum(b["size"] for b in blocks)
        out.append({"address": seg["address"], "total_size": total, "blocks": blocks})
    return out


def _reset_peak(device: Any = None) -> None:
    _budget().reset_peak()


def install() -> None:
    """Make `torch.cuda` a fake CUDA node of `gpus()` GPUs in this process (idempotent)."""
    n = gpus()
    if n == 0 or active():
        return
    cuda = torch.cuda
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: n,
        "is_initialized": lambda: True,
        "current_device": lambda: int(os.environ.get("LOCAL_RANK", "0")),
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_device_properties": _properties,
        "get_device_name": lambda device=None: GPU_NAME,
        "memory_allocated": lambda device=None: _budget().allocator.allocated,
        "max_memory_allocated": lambda device=None: _budget().allocator.peak_allocated,
        "memory_reserved": lambda device=None: _budget().allocator.reserved,
        "max_memory_reserved": lambda device=None: _budget().allocator.peak_reserved,
        "reset_peak_memory_stats": _reset_peak,
        "memory_stats": _stats,
        "memory_snapshot": _snapshot,
        "empty_cache": lambda: _budget().allocator.empty_cache(),
        "mem_get_info": lambda device=None: (
            _budget().allocator.capacity_bytes - _budget().allocator.reserved, TOTAL_BYTES
        ),
        "set_per_process_memory_fraction": _set_fraction,
        "Event": _Event,
    }
    for name, value in patches.items():
        setattr(cuda, name, value)
    cuda.nccl = SimpleNamespace(version=lambda: (2, 27, 3))
    for name in ("range_push", "range_pop", "mark"):
        setattr(cuda.nvtx, name, lambda *a, **k: 0)
    _new_budget()
    os.register_at_fork(after_in_child=_empty_gpu_in_child)
