"""This rank's device memory: the warm baseline, the memory limit, live and peak bytes, the peak of a step.

One home for every memory number the labs print, in both worlds:

* on a GPU, CUDA's caching allocator (`torch.cuda.memory_allocated` and friends), net of the rank's *warm
  baseline*: what the process holds once cuBLAS has made its handles and workspaces for the main thread and
  for autograd's device thread (32 MiB each on Hopper, from the same allocator). Every GPU rank records it at
  start (`record_baseline`, called by `labkit.machine.rank_setup`), capped or not, so no peak counts
  the workspaces;
* on the emulated cluster, the rank's `labkit.machine.emulate.MemoryBudget` (live tensor bytes);
* elsewhere (a CPU rank without a budget) nothing counts memory until `tracked()` opens a budget that only
  counts.

`cap_above_baseline(dev, memory_gib)` caps a GPU rank for the rest of its process
(`set_per_process_memory_fraction` caps *reserved* memory, so the cap is set above what the warm process
reserves); `memory_limit(nbytes)` limits one block of work to `nbytes` beyond what the process holds when it
starts (a GPU cap lifted afterwards, a `MemoryBudget` on the CPU). `step_peak(step)` runs one step and returns
its peak (`StepPeak`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from labkit.machine import emulate, runtime

__all__ = [
    "StepPeak",
    "baseline_bytes",
    "cap_above_baseline",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_limit",
    "peak_bytes",
    "record_baseline",
    "reset_peak_memory_stats",
    "step_peak",
    "tracked",
]

T = TypeVar("T")
# What this process held on its GPU once warm (allocated, reserved). Process state by nature: one GPU
# process, one baseline; kept in the environment so that a forked helper of the rank reads the same.
_BASELINE_ENV = "LABKIT_GPU_BASELINE_BYTES"
_RESERVED_ENV = "LABKIT_GPU_BASELINE_RESERVED_BYTES"


# ------------------------------------------------------------ the warm baseline


def record_baseline(dev: torch.device) -> int:
    """Warm this rank's GPU up and record what it holds then; return the allocated bytes.

    One small matmul forward and backward makes cuBLAS's handle and workspace for this thread and for
    autograd's device thread, which runs the backward, from the caching allocator.
    """
    a = torch.randn(64, 64, device=dev, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize(dev)
    allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    os.environ[_BASELINE_ENV] = str(allocated)
    os.environ[_RESERVED_ENV] = str(reserved)
    return allocated


def baseline_bytes() -> int:
    """What this rank held on its GPU once warm (0 before `record_baseline`, and on the CPU)."""
    return int(os.environ.get(_BASELINE_ENV, "0"))


def _set_cap(dev: torch.device, reserved_bytes: int | None) -> None:
    """Cap what the caching allocator may reserve on `dev` at `reserved_bytes` (None: the whole card)."""
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = 1.0 if reserved_bytes is None else min(1.0, reserved_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)


def cap_above_baseline(dev: torch.device, memory_gib: float) -> None:
    """Cap this rank's GPU memory for the rest of the process, `memory_gib` above its warm baseline.

    A cap of 48 MiB from zero would run out on cuBLAS's workspaces, not on the lab's tensors (blocks are
    rounded to 2 or 20 MiB), so the cap sits above what the warm process reserves.
    """
    if not os.environ.get(_BASELINE_ENV):
        record_baseline(dev)
    _set_cap(dev, int(os.environ.get(_RESERVED_ENV, "0")) + int(memory_gib * 2**30))


@contextlib.contextmanager
def memory_limit(
    nbytes: int, *, rank: int = 0, device: torch.device | None = None
) -> Iterator[emulate.MemoryBudget | None]:
    """Inside, the work has `nbytes` of device memory beyond what this process holds now: an OOM past it is
    the card's OOM.

    On a GPU: cached blocks are returned first (they would count against the cap), what stays reserved (the
    warm baseline, tensors still alive) is kept outside, the cap is set `nbytes` above it and lifted
    afterwards. On the CPU: a `MemoryBudget` of `nbytes`, which counts the tensors made inside it
    (`budget.track(...)` adds older ones). `device`: this rank's (`labkit.machine.runtime.device()`) unless
    given. Yields the budget, or None on a GPU."""
    if _cuda(device):
        dev = device if device is not None else runtime.device()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        _set_cap(dev, torch.cuda.memory_reserved(dev) + nbytes)
        try:
            yield None
        finally:
            _set_cap(dev, None)
        return
    simulated = emulate.active_budget()
    if isinstance(simulated, emulate.SimulatedDevice):  # a simulated card: its limit, for a while
        with simulated.limited(nbytes):
            yield None
        return
    with emulate.MemoryBudget(nbytes, rank=rank) as budget:
        yield budget


# ---------------------------------------------------------- live and peak bytes


def _cuda(dev: torch.device | str | None) -> bool:
    """Is `dev` (None: this rank's) served by torch.cuda's memory API? The rank's own device is on a GPU
    rank, which on CI's fake CUDA machine is the CPU."""
    if dev is None or torch.device(dev) == runtime.device():
        return runtime.on_gpu()
    return torch.device(dev).type == "cuda"


def memory_allocated(device: torch.device | str | None = None) -> int:
    """Bytes in live tensors: CUDA's allocator on a GPU (net of the warm baseline), the emulated budget on the
    CPU (0 without one)."""
    if _cuda(device):
        return max(0, torch.cuda.memory_allocated(device) - baseline_bytes())
    budget = emulate.active_budget()
    return budget.allocated if budget is not None else 0


def max_memory_allocated(device: torch.device | str | None = None) -> int:
    """Peak bytes in live tensors since the last `reset_peak_memory_stats` (net of the warm baseline)."""
    if _cuda(device):
        return max(0, torch.cuda.max_memory_allocated(device) - baseline_bytes())
    budget = emulate.active_budget()
    return budget.peak if budget is not None else 0


def max_memory_reserved(device: torch.device | str | None = None) -> int:
    """Peak bytes the allocator reserved since the last `reset_peak_memory_stats` (net of the warm baseline's
    reserved bytes): what a GPU's memory cap limits. Without an allocator model (the emulated budget's
    default, a simulated card) the live bytes' peak."""
    if _cuda(device):
        return max(0, torch.cuda.max_memory_reserved(device) - int(os.environ.get(_RESERVED_ENV, "0")))
    budget = emulate.active_budget()
    if isinstance(budget, emulate.MemoryBudget):
        return budget.peak_reserved
    return budget.peak if budget is not None else 0


def reset_peak_memory_stats(device: torch.device | str | None = None) -> None:
    """Start a new peak at the bytes in use now."""
    if _cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return
    budget = emulate.active_budget()
    if budget is not None:
        budget.reset_peak()


def _source() -> str | None:
    """What measures memory on this rank now (None: nothing)."""
    if runtime.on_gpu():
        return "torch.cuda.max_memory_allocated, net of the warm baseline"
    budget = emulate.active_budget()
    if isinstance(budget, emulate.SimulatedDevice):
        return budget.source
    return "emulated budget" if budget is not None else None


def peak_bytes() -> tuple[int, str] | None:
    """(peak bytes since the last reset, what measured it) on this rank; None where nothing tracks memory
    (a CPU rank outside `tracked()` and without an emulated budget)."""
    source = _source()
    return None if source is None else (max_memory_allocated(runtime.device()), source)


@contextlib.contextmanager
def tracked() -> Iterator[None]:
    """Inside, this rank's memory is measured: as it is on a GPU or an emulated budget, else by a budget that
    only counts (no limit), opened here. Open it before the model is made, so that its bytes count too."""
    if _source() is not None:
        yield
        return
    with emulate.MemoryBudget(2**50):
        yield


@dataclass(frozen=True)
class StepPeak:
    """The memory of one step on one rank: bytes held when it started, the most held at once, and what
    measured them."""

    start_bytes: int
    peak_bytes: int
    source: str
    # the allocator's reserved peak, what a GPU's cap limits (not compared: it follows from the allocator)
    reserved_peak_bytes: int = field(default=0, compare=False)

    @property
    def added_bytes(self) -> int:
        """What the step itself added at its peak (activations, temporaries), over what it started with."""
        return self.peak_bytes - self.start_bytes


def step_peak(step: Callable[[], T]) -> tuple[T, StepPeak]:
    """Run `step()` and return (its result, its `StepPeak`), from this rank's memory stats.

    The device is synchronised on both sides (a GPU's kernels are asynchronous). Where nothing tracks memory
    the step runs inside `tracked()`, which then counts only the tensors the step makes (start 0).
    """
    with tracked():
        runtime.synchronize()
        start = memory_allocated()
        reset_peak_memory_stats()
        result = step()
        runtime.synchronize()
        peak = max_memory_allocated()
        reserved = max_memory_reserved()
        source = _source() or "emulated budget"
    return result, StepPeak(start, max(start, peak), source, max(reserved, peak))
