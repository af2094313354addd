"""A per-rank memory budget for the emulated cluster, with the CUDA allocator's kind of OOM.

`MemoryBudget` is a TorchDispatchMode that counts the bytes of live tensor storages on a
rank and raises `torch.OutOfMemoryError` when an allocation would go over the budget, with
a message shaped like the CUDA caching allocator's. `labkit.launch` turns it on for a
cluster made with `Cluster.emulated(memory_gib=...)`; `labkit.machine.device_memory.memory_allocated`
and friends read it. By default it counts tensor bytes only: no allocator rounding or segments.
With `allocator="caching"` (or "expandable", or a `CachingAllocator` of `allocator.py`) every
counted storage is also malloc'ed from that model of CUDA's caching allocator, whose OOM (with
fragmentation) is then the budget's, and `reserved` is what the allocator holds.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from labkit import validate
from labkit.machine import _torch_compat as compat
from labkit.machine.emulate import cpu_matmul
from labkit.machine.emulate.allocator import CachingAllocator
from labkit.machine.emulate.clock import rank_clock
from labkit.machine.emulate.simulated_device import SimulatedDevice, storage_resized

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

    `allocator`: None (count live tensor bytes against `limit_bytes`), "caching" or
    "expandable" (a `CachingAllocator` of `limit_bytes`, with expandable segments for the
    latter), or a `CachingAllocator` whose capacity is `limit_bytes`. `allocated` and `peak`
    stay live tensor bytes; `reserved` and `peak_reserved` are the allocator's (equal to
    `allocated` and `peak` without one).
    """

    def __init__(
        self,
        limit_bytes: int,
        *,
        rank: int = 0,
        device_name: str = "emulated GPU",
        allocator: CachingAllocator | str | None = None,
        off_the_clock: bool = False,
    ) -> None:
        super().__init__()
        # Keep the counting off the rank's virtual clock (CI's fake CUDA machine, whose budget counts every
        # operator of every timed step: its bookkeeping added 30-40 % to lab 05's steps there)
        self.off_the_clock = off_the_clock
        validate.positive_int(
            "MemoryBudget limit_bytes", limit_bytes, "MemoryBudget(256 * 2**20) for 256 MiB"
        )
        self.limit_bytes = int(limit_bytes)
        self.rank = rank
        self.device_name = device_name
        if allocator is not None and not isinstance(allocator, CachingAllocator):
            validate.one_of(
                "MemoryBudget allocator",
                allocator,
                ("caching", "expandable"),
                'MemoryBudget(n, allocator="caching") or allocator=CachingAllocator(n)',
            )
            allocator = CachingAllocator(
                self.limit_bytes,
                expandable_segments=allocator == "expandable",
                device=f"Rank {rank}'s {device_name}",
            )
        elif allocator is not None and allocator.capacity_bytes != self.limit_bytes:
            raise ValueError(
                f"allocator.capacity_bytes={allocator.capacity_bytes} must equal limit_bytes="
                f"{self.limit_bytes}; e.g. MemoryBudget(n, allocator=CachingAllocator(n))"
            )
        self.allocator = allocator
        self.allocated = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._handles: dict[int, int] = {}  # storage key -> allocator handle
        # A garbage collection run inside the lock (the allocator allocates Python objects) may free
        # a storage and call _release on this thread: an RLock lets it in, and it only queues.
        self._lock = threading.RLock()
        self._busy = False
        self._pending: list[int] = []  # storage keys freed while the lock's holder was busy
        compat.report_storage_resizes(storage_resized)

    def _count(self, t: torch.Tensor) -> None:
        if compat.is_wrapper_subclass(t):
            # A DTensor (FSDP2's sharded parameters and gradients): its own storage has the global shape and
            # no memory; the local shards inside hold it
            for local in compat.tree_leaves(compat.unwrapped(t)):
                self._count(local)
            return
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta or compat.is_fake(t):
            return  # a FakeTensor (a simulated rank's, under CI's fake CUDA budget too) holds no memory
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        # keyed by the storage object, not its address: a storage resized in place (FSDP2) moves its memory
        key = id(storage)
        size = storage.nbytes()
        if size == 0:
            return
        with self._lock:
            self._busy = True
            try:
                self._drain()  # a release queued under a collection first: its id may be this storage's now
                self._busy = True
                if key in self._seen:
                    return
                self._take(key, size)
            finally:
                self._drain()
        weakref.finalize(storage, self._release, key)

    def _take(self, key: int, size: int) -> None:
        """`size` more bytes for storage `key`, or the OOM; called holding the lock."""
        if self.allocator is not None:
            self._handles[key] = self.allocator.malloc(size)  # its OOM is the budget's
        elif self.allocated + size > self.limit_bytes:
            in_use = self.allocated
            raise torch.OutOfMemoryError(
                f"{self.device_name} out of memory (emulated budget). Tried to allocate "
                f"{_fmt(size)}. Rank {self.rank} has a total capacity of {_fmt(self.limit_bytes)} of "
                f"which {_fmt(self.limit_bytes - in_use)} is free. {_fmt(in_use)} is allocated by "
                "live tensors. Reduce the micro-batch, accumulate gradients, use bf16 autocast or "
                "activation checkpointing; see labkit.memory."
            )
        self._seen[key] = size
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """`storage` now holds `nbytes`: FSDP2 frees an unsharded parameter's memory and takes it back with
        `untyped_storage().resize_`, which no operator dispatch sees (`compat.report_storage_resizes`)."""
        key = id(storage)
        with self._lock:
            self._busy = True
            try:
                self._drain()  # releases queued under a collection first: one may be of this id
                self._busy = True
                known = key in self._seen
                self._free(key)  # the old size, whatever it was
                if nbytes:
                    self._take(key, nbytes)
            finally:
                self._drain()
        if not known and nbytes:
            weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            self._pending.append(key)
            if not self._busy:  # else this thread is inside _count or _drain, which drains the queue
                self._busy = True
                self._drain()

    def _drain(self) -> None:
        """Apply the queued releases; called holding the lock with `_busy` set, which it clears."""
        try:
            while self._pending:
                self._free(self._pending.pop())
        finally:
            self._busy = False

    def _free(self, key: int) -> None:
        """Storage `key`'s bytes are free (nothing where it holds none); called holding the lock."""
        size = self._seen.pop(key, None)
        if size is not None:
            self.allocated -= size
            if self.allocator is not None:
                self.allocator.free(self._handles.pop(key))

    @property
    def reserved(self) -> int:
        """Bytes the allocator holds (`memory_reserved`); `allocated` without an allocator."""
        return self.allocator.reserved if self.allocator is not None else self.allocated

    @property
    def peak_reserved(self) -> int:
        return self.allocator.peak_reserved if self.allocator is not None else self.peak

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

    def forget(self) -> None:
        """Start afresh: nothing counted, a fresh allocator of the same capacity (a forked process's view of
        its own device: its parent's storages, freed there, are not its own and are ignored)."""
        with self._lock:
            if self.allocator is not None:
                old = self.allocator
                self.allocator = CachingAllocator(
                    old.capacity_bytes,
                    expandable_segments=old.expandable_segments,
                    max_split_size=old.max_split_size,
                    device=old.device,
                )
            self._seen.clear()
            self._handles.clear()
            self._pending.clear()
            self.allocated = self.peak = 0

    def reset_peak(self) -> None:
        """Peaks (of live bytes, and of the allocator's) back to the current values."""
        with self._lock:
            self.peak = self.allocated
            if self.allocator is not None:
                self.allocator.reset_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = cpu_matmul.compute(func, args, kwargs or {})  # a GPU's fp32 accumulation, at fp32 speed
        with rank_clock().paused() if self.off_the_clock else contextlib.nullcontext():
            for t in compat.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._count(t)
        return out


def active_budget() -> MemoryBudget | SimulatedDevice | None:
    """The innermost memory budget active on this thread, if any: a MemoryBudget, or on a simulated machine
    the SimulatedDevice that holds tensors to the described card (both have `allocated`, `peak`,
    `reset_peak`, `track`)."""
    for mode in reversed(compat.dispatch_mode_stack()):
        if isinstance(mode, (MemoryBudget, SimulatedDevice)):
            return mode
    return None
