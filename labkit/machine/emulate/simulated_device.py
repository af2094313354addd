"""The simulated GPU of a rank: every operator takes its time on a described GPU, memory is the card's.

`SimulatedDevice` is a TorchDispatchMode that sits above a FakeTensorMode: the rank's real PyTorch program
runs at GPU size on tensors with shapes and dtypes but no storage, so its CPU time follows the operators'
count, not their size (measured: the forward and backward of a Llama-2-7B-shaped GPT at 4096 tokens in bf16,
946 operators, took 0.42 s of CPU on a 2-core VM for 282 ms of simulated H100 time); each operator it
dispatches:

* advances the rank's modelled clock (`clock.VirtualClock(modelled=True).spend`) by its kernel's time on
  the described GPU, `labkit.op_time.kernel_s`: a matmul (`mm`, `addmm`, `bmm`, `baddbmm`) by its shape, an
  attention kernel by its FLOPs (`op_time.attention_flops`), any other operator with a FLOP formula in
  torch's own counter (`torch.utils.flop_counter.flop_registry`, e.g. convolutions) by its FLOPs, and every
  operator by the bytes of its inputs and outputs. The host issues one operator per `op_time.DISPATCH_S` on
  a clock of its own, as eager PyTorch runs ahead of an asynchronous GPU: a kernel starts when the previous
  one has ended and the host has issued it, so long kernels hide the host and short ones wait for it
  (the "host" share of `times`); reading the timer synchronises the two, as `torch.cuda.synchronize` does.
  Views and metadata (a `view`, a `transpose`, `detach`), allocations and `.item()` of an optimizer's step
  count (a CPU tensor on a GPU) launch no kernel and cost nothing;
* counts the bytes of every new storage until it is freed, and raises `torch.OutOfMemoryError` past the
  card's memory, shaped like the CUDA allocator's message (tensor bytes only: no allocator rounding,
  fragmentation or CUDA context, which the message says). A storage resized in place (FSDP2 frees and
  refills its gathered parameters so) holds its new size (`resized`). An operator on a DTensor (FSDP2's
  sharded parameters) is timed and counted on the local shards inside it.

What it cannot show: numerics (values are not computed: the emulated cluster checks gradients at small
size), kernels competing for SMs, cache effects, and an allocator's rounding. Every number made with it is
labelled "simulated <GPU>" (`Cluster.label`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry

from labkit import op_time
from labkit.machine import _torch_compat as compat
from labkit.machine.emulate.clock import VirtualClock
from labkit.op_time import GpuSpec

__all__ = ["OpTimes", "SimulatedDevice", "active_simulated_device", "storage_resized"]

_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}
# Fused attention: (forward or backward, the position of is_causal among the arguments). The CPU kernel
# is what runs here; the CUDA ones are what runs on the described GPU (their FLOPs are the same).
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu: ("forward", 4),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: ("backward", 7),
    _aten._scaled_dot_product_flash_attention: ("forward", 4),
    _aten._scaled_dot_product_flash_attention_backward: ("backward", 8),
}
# No kernel on a GPU: a tensor that is the same storage, or memory handed out by the caching allocator
# without being written (the allocation is counted, its time is not).
_FREE = {
    _aten.detach, _aten.lift_fresh, _aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided
}
_DEVICE_QUERY = torch.ops.prim.device.default
_SCALAR_READ = _aten._local_scalar_dense.default
# Namespaces of operators that launch no kernel: metadata (prim.device) and the profiler's range markers.
_NO_KERNEL = {"prim", "profiler"}
# In-place operators that overwrite their first argument without reading it.
_OVERWRITE = {_aten.zero_, _aten.fill_, _aten.copy_}


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs (tensors, tuples, lists, dicts of them, scalars), in
    order: what torch's tree_leaves finds there, at half its cost (it runs for every operator)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class OpTimes:
    """What a simulated device spent its modelled time on: seconds and operator counts per kind of kernel
    ("matmul", "attention", "other": memory-bound or counted FLOPs), and "host": the device idle, waiting for
    the host to issue the next operator."""

    seconds: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    flops: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


class SimulatedDevice(compat.TorchDispatchMode):
    """Time each operator on `gpu` (onto `clock` when given) and hold live storage bytes to the card.

    Enter it inside a FakeTensorMode. `limit_bytes` defaults to the card's memory; `rank` goes into the OOM
    message. `times` says where the modelled time went; `allocated` and `peak` are bytes.
    """

    def __init__(
        self,
        gpu: GpuSpec,
        clock: VirtualClock | None = None,
        *,
        limit_bytes: int | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__()
        if clock is not None and not clock.modelled:
            raise ValueError("SimulatedDevice needs a modelled clock: VirtualClock(modelled=True)")
        self.gpu = gpu
        self.clock = clock
        self.limit_bytes = int(limit_bytes if limit_bytes is not None else gpu.memory_gib * 2**30)
        self.rank = rank
        self.times = OpTimes()
        self.allocated = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # id of a live storage -> its bytes
        compat.report_storage_resizes(storage_resized)
        self._host_s = 0.0  # when the host will have issued every operator so far, on the device's timeline
        self._device_s = 0.0  # the device's time without a clock (one process, no rank)

    # -- time ------------------------------------------------------------------------------

    def now(self) -> float:
        """The device's time: its clock's, or its own without one."""
        return self.clock.now() if self.clock is not None else self._device_s

    def synchronize(self) -> None:
        """The host waits for the device (a timer reading, `torch.cuda.synchronize`)."""
        self._host_s = max(self._host_s, self.now())

    def _run(self, kind: str, seconds: float) -> None:
        """One kernel of `seconds`, issued by the host after the previous operator's dispatch."""
        now = self.now()
        self._host_s += self.gpu.dispatch_s
        idle = max(0.0, self._host_s - now)
        self.times.seconds[kind] += seconds
        self.times.seconds["host"] += idle
        if self.clock is not None:
            self.clock.spend(idle + seconds)
        else:
            self._device_s += idle + seconds

    def op_seconds(self, func, args, kwargs, out) -> tuple[str, float, float]:
        """(kind, kernel seconds, FLOPs) of one operator on the described GPU."""
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        # what the kernel reads and writes: every input and output, except the old values of a tensor that
        # is only overwritten (zero_, fill_, copy_'s destination)
        read = ins[1:] if func.overloadpacket in _OVERWRITE else ins
        nbytes = _nbytes(read) + _nbytes(outs)
        # The operands' precision picks the peak: the first floating input (a matmul's A, attention's q or
        # its output's gradient), not a float32 side input such as attention's logsumexp.
        elem = next((t.element_size() for t in ins if t.is_floating_point()), 4)
        packet = func.overloadpacket
        if packet in _MATMULS:
            a, b = (args[0], args[1]) if packet in (_aten.mm, _aten.bmm) else (args[1], args[2])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            seconds = op_time.kernel_s(self.gpu, nbytes=nbytes, matmul=(batch, m, n, k), element_bytes=elem)
            return "matmul", seconds, 2.0 * batch * m * n * k
        if packet in _ATTENTION:
            direction, causal_at = _ATTENTION[packet]
            q = args[1] if direction == "backward" else args[0]
            k = args[2] if direction == "backward" else args[1]
            causal = bool(args[causal_at]) if len(args) > causal_at else bool(kwargs.get("is_causal", False))
            b, h, s_q, d = q.shape
            flops = op_time.attention_flops(b, h, s_q, k.shape[-2], d, causal)
            flops *= 2.5 if direction == "backward" else 1.0
            seconds = op_time.kernel_s(
                self.gpu, nbytes=nbytes, flops=flops, attention=direction, element_bytes=elem
            )
            return "attention", seconds, flops
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        return "other", op_time.kernel_s(self.gpu, nbytes=nbytes, flops=flops, element_bytes=elem), flops

    # -- memory ----------------------------------------------------------------------------

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self._live or size == 0:
            return
        self._grow(size)
        self._live[key] = size
        weakref.finalize(storage, self._release, key)

    def _grow(self, nbytes: int) -> None:
        """`nbytes` more are live, or the card's out-of-memory error."""
        if self.allocated + nbytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"{self.gpu.name} out of memory (simulated). Tried to allocate {_fmt(nbytes)}. "
                f"Rank {self.rank} has a total capacity of {_fmt(self.limit_bytes)} of which "
                f"{_fmt(self.limit_bytes - self.allocated)} is free. {_fmt(self.allocated)} is allocated by "
                "live tensors (tensor bytes only: no allocator rounding, fragmentation or CUDA context). "
                "Reduce the micro-batch, accumulate gradients, use bf16 or activation checkpointing; see "
                "labkit.memory.estimate."
            )
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def _release(self, key: int) -> None:
        size = self._live.pop(key, None)
        if size is not None:
            self.allocated -= size

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """`storage` now holds `nbytes`. FSDP2 frees an unsharded parameter's memory and takes it back this
        way (`free_storage` / `alloc_storage`: `untyped_storage().resize_`, which no operator dispatch sees),
        keeping the tensor."""
        key = id(storage)
        if key not in self._live:
            if nbytes:
                self._grow(nbytes)
                self._live[key] = nbytes
                weakref.finalize(storage, self._release, key)
            return
        if nbytes > self._live[key]:
            self._grow(nbytes - self._live[key])
        else:
            self.allocated -= self._live[key] - nbytes
        self._live[key] = nbytes

    def track(self, *objs: object) -> None:
        """Count tensors, modules (parameters and buffers) or optimizers made before the device."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
            elif isinstance(obj, torch.optim.Optimizer):
                tensors = [v for state in obj.state.values() for v in state.values()]
            else:
                tensors = [obj]
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self._count(t)

    def reset_peak(self) -> None:
        self.peak = self.allocated

    @property
    def source(self) -> str:
        """What measures memory here, for a StepPeak."""
        return f"simulated {self.gpu.name} (tensor bytes)"

    @contextlib.contextmanager
    def limited(self, nbytes: int) -> Iterator[SimulatedDevice]:
        """Inside, `nbytes` beyond what is allocated now (`labkit.machine.device_memory.memory_limit`)."""
        saved, self.limit_bytes = self.limit_bytes, min(self.limit_bytes, self.allocated + int(nbytes))
        try:
            yield self
        finally:
            self.limit_bytes = saved

    # -- the mode --------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and compat.is_fake(args[0]):
            # C++ (autograd, TensorIterator) asks a FakeTensor for its device around most operators: 7 in
            # 10 of what reaches this mode. The FakeTensorMode below answers with the tensor's `device`
            # property; answered here, the query skips a second Python dispatch.
            return args[0].device
        if func is _SCALAR_READ and (constant := compat.fake_constant(args[0])) is not None:
            # `.item()` of a FakeTensor that carries its real value: an optimizer's step count (torch keeps
            # it on the CPU beside CUDA parameters: no GPU kernel), read twice per parameter per step. The
            # FakeTensorMode below reads it the same way, after a cache lookup it always bypasses.
            with compat.real_tensors():
                return constant.item()
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _NO_KERNEL:
            return out
        seen = (args, kwargs, out)
        if any(compat.is_wrapper_subclass(t) for t in _tensors(seen)):
            # A DTensor's operator (FSDP2's sharded parameters, their gradients, the optimizer on them) runs
            # on the local tensors inside, below this mode: time and count those, not the wrapper, whose own
            # storage is the global shape's and holds no memory.
            seen = compat.unwrapped(seen)
        for t in _tensors(seen[2]):  # a new storage is counted, whatever made it (a view's is its base's)
            self._count(t)
        if func.is_view or func.overloadpacket in _FREE:
            return out
        kind, seconds, flops = self.op_seconds(func, *seen)
        self.times.ops[kind] += 1
        self.times.flops += flops
        self._run(kind, seconds)
        return out


def storage_resized(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Tell the innermost mode that holds storages to a budget (a SimulatedDevice, or the emulated cluster's
    MemoryBudget: both have `resized`) that `storage` now holds `nbytes`."""
    for mode in reversed(compat.dispatch_mode_stack()):
        resized = getattr(mode, "resized", None)
        if resized is not None:
            resized(storage, nbytes)
            return


def active_simulated_device() -> SimulatedDevice | None:
    """The innermost SimulatedDevice active on this thread, if any."""
    for mode in reversed(compat.dispatch_mode_stack()):
        if isinstance(mode, SimulatedDevice):
            return mode
    return None
