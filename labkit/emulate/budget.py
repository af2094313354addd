"""A per-rank memory budget for the emulated cluster, with the CUDA allocator's kind of OOM.

`MemoryBudget` is a TorchDispatchMode that counts the bytes of live tensor storages on a
rank and raises `torch.OutOfMemoryError` when an allocation would go over the budget, with
a message shaped like the CUDA caching allocator's. `labkit.launch` turns it on for a
cluster made with `Cluster.emulated(memory_gib=...)`; `labkit.runtime.memory_allocated`
and friends read it. It counts tensor bytes only: no allocator rounding or segments.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from labkit import _torch_compat as compat
from labkit import validate

__all__ = ["MemoryBudget", "active_budget"]


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


class MemoryBudget(compat.TorchDispatchMode):
    """Track live tensor bytes on this rank and raise OOM past `limit_bytes`.

    Every tensor an operator returns while the mode is active is counted once per storage
    until that storage is freed (a weakref finaliser). Tensors that existed before the
    mode started can be counted with `track(...)`. The check runs when an operator returns,
    so the failed allocation briefly exists in host memory; the lesson (which allocation
    tipped the rank over, and how much was in use) is the same as on a GPU.
    """

    def __init__(self, limit_bytes: int, *, rank: int = 0, device_name: str = "emulated GPU") -> None:
        super().__init__()
        validate.positive_int("MemoryBudget limit_bytes", limit_bytes, "MemoryBudget(256 * 2**20) for 256 MiB")
        self.limit_bytes = int(limit_bytes)
        self.rank = rank
        self.device_name = device_name
        self.allocated = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._lock = threading.Lock()

    def _count(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        key = storage.data_ptr()
        size = storage.nbytes()
        if key == 0 or size == 0:
            return
        with self._lock:
            if key in self._seen:
                return
            if self.allocated + size > self.limit_bytes:
                in_use = self.allocated
                raise torch.OutOfMemoryError(
                    f"{self.device_name} out of memory (emulated budget). Tried to allocate {_fmt(size)}. "
                    f"Rank {self.rank} has a total capacity of {_fmt(self.limit_bytes)} of which "
                    f"{_fmt(self.limit_bytes - in_use)} is free. {_fmt(in_use)} is allocated by live tensors. "
                    "Reduce the micro-batch, accumulate gradients, use bf16 autocast or activation "
                    "checkpointing; see labkit.memory."
                )
            self._seen[key] = size
            self.allocated += size
            self.peak = max(self.peak, self.allocated)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        with self._lock:
            if self._seen.get(key) == size:
                del self._seen[key]
                self.allocated -= size

    def track(self, *objs: Any) -> None:
        """Count tensors, modules (parameters and buffers) or optimizers made before the mode."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    self._count(t)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for v in state.values():
                        self._count(v)
            elif isinstance(obj, torch.Tensor):
                self._count(obj)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in compat.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def active_budget() -> MemoryBudget | None:
    """The innermost MemoryBudget active on this thread, if any."""
    for mode in reversed(compat.dispatch_mode_stack()):
        if isinstance(mode, MemoryBudget):
            return mode
    return None


