"""The emulated cluster: a modelled interconnect over gloo, and a per-rank memory budget.

Two ideas live here, both used only when there are no GPUs to run on:

* **Links.** `EmulatedProcessGroup` wraps a real `ProcessGroupGloo`. Every collective does
  the real gloo transfer (numerics stay real) and its work completes no earlier than an
  α-β model of the link says it would on a GPU node. Asynchronous collectives complete on
  a background thread, so overlap with compute is real overlap.
* **Memory.** `MemoryBudget` counts the bytes of live tensors on a rank and raises
  `torch.OutOfMemoryError` when an allocation would go over the budget, with a message
  shaped like the CUDA caching allocator's.

The α-β model and the ring-algorithm step counts follow Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), which is
also what nccl-tests' bus-bandwidth factors assume
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

BACKEND_NAME = "labkit_emulated"


# --------------------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    """One class of link (for example NVLink inside a node, InfiniBand between nodes).

    `bandwidth_gb_s` is the bandwidth one rank sees in one direction, in GB/s (1e9 bytes);
    `latency_us` is the fixed cost α of one message, in microseconds.
    """

    bandwidth_gb_s: float
    latency_us: float = 10.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0:
            raise ValueError(
                f"Link bandwidth_gb_s={self.bandwidth_gb_s} must be > 0; "
                "give the link's one-direction bandwidth in GB/s, e.g. Link(bandwidth_gb_s=25)."
            )
        if self.latency_us < 0:
            raise ValueError(f"Link latency_us={self.latency_us} must be >= 0; e.g. Link(..., latency_us=5).")

    def message_s(self, nbytes: float) -> float:
        """α + n/β: seconds to move one message of `nbytes` over this link."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)

    def to_dict(self) -> dict:
        return {"bandwidth_gb_s": self.bandwidth_gb_s, "latency_us": self.latency_us, "name": self.name}


def collective_time_s(op: str, nbytes: int, n: int, link: Link) -> float:
    """Modelled seconds for a collective over `n` ranks whose slowest link is `link`.

    `nbytes` is the size of the buffer each rank contributes (all_reduce, broadcast, the
    output of all_gather, the input of reduce_scatter, one point-to-point message).
    Ring algorithms: all_reduce is a reduce-scatter then an all-gather, 2(n-1) steps each
    moving nbytes/n, so T = 2(n-1)·(α + nbytes/(n·β)); all_gather and reduce_scatter take
    (n-1) such steps; a pipelined ring broadcast costs (n-1)·α + nbytes/β.
    """
    if n <= 1:
        return 0.0
    a = link.latency_us * 1e-6
    b = link.bandwidth_gb_s * 1e9
    if op in ("all_reduce", "barrier"):
        return 2 * (n - 1) * (a + nbytes / (n * b))
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * (a + nbytes / (n * b))
    if op in ("broadcast", "reduce", "gather", "scatter"):
        return (n - 1) * a + nbytes / b
    if op in ("send", "recv"):
        return a + nbytes / b
    raise ValueError(f"no time model for collective {op!r}")


@dataclass(frozen=True)
class Topology:
    """Which global rank sits on which node, and the two link classes."""

    gpus_per_node: int
    intra_node: Link
    inter_node: Link

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.gpus_per_node

    def slowest_link(self, global_ranks: list[int]) -> Link:
        """The link a collective over these ranks must cross: inter-node if they span nodes."""
        nodes = {self.node_of(r) for r in global_ranks}
        return self.inter_node if len(nodes) > 1 else self.intra_node


# ------------------------------------------------------------- the process group


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _LinkClock:
    """Serialises modelled transfers on one link direction, like one NCCL stream does.

    A transfer issued while an earlier one is still on the wire starts when that one ends.
    """

    def __init__(self) -> None:
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def reserve(self, now: float, seconds: float) -> float:
        with self._lock:
            start = max(now, self._busy_until)
            self._busy_until = start + seconds
            return self._busy_until


class CollectiveRecord:
    """The collectives a rank issued, kept for hang and mismatch diagnosis.

    With a `path`, every change is also written to a small memory-mapped file, so the
    launcher can read what a rank was doing even after gloo aborted the process (a size
    mismatch ends in `std::terminate` inside a gloo thread, where Python cannot catch it).
    """

    SIZE = 4096

    def __init__(self, path: str | None = None) -> None:
        self.seq = 0
        self.status = "running"
        self.last: dict[str, Any] | None = None
        self.in_flight: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        if path:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, self.SIZE)
                self._mm = mmap.mmap(fd, self.SIZE)
            finally:
                os.close(fd)
            self._write()

    def issued(self, op: str, tensors: list[torch.Tensor], peer: int | None = None) -> int:
        with self._lock:
            self.seq += 1
            entry = {
                "seq": self.seq,
                "op": op,
                "shapes": [list(t.shape) for t in tensors],
                "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                "peer": peer,
            }
            self.last = entry
            self.in_flight[self.seq] = entry
            self._write()
            return self.seq

    def completed(self, seq: int) -> None:
        with self._lock:
            self.in_flight.pop(seq, None)
            self._write()

    def finish(self, status: str) -> None:
        """Mark how the rank's function ended: "returned" or "raised"."""
        with self._lock:
            self.status = status
            self._write()

    def _snapshot(self) -> dict[str, Any]:
        pending = sorted(self.in_flight.values(), key=lambda e: e["seq"])
        return {"count": self.seq, "last": self.last, "pending": pending[:1], "status": self.status}

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot()

    def _write(self) -> None:
        if self._mm is not None:
            data = json.dumps(self._snapshot()).encode()[: self.SIZE]
            self._mm[:] = data.ljust(self.SIZE, b" ")

    @staticmethod
    def read(path: str) -> dict[str, Any] | None:
        """A rank's record from its file, or None when absent or torn."""
        try:
            with open(path, "rb") as f:
                return json.loads(f.read().decode())
        except (OSError, ValueError):
            return None


class EmulatedProcessGroup(dist.ProcessGroup):
    """A gloo process group whose collectives take the modelled time of a GPU interconnect.

    Each call forwards to the wrapped `ProcessGroupGloo` (the data really moves), then a
    completion thread finishes the returned work when both the gloo transfer is done and
    the link model's time has passed since the transfer could start on the link.
    """

    def __init__(
        self,
        inner: dist.ProcessGroup,
        rank: int,
        size: int,
        global_ranks: list[int],
        topology: Topology,
        timeout: timedelta,
        record_path: str | None = None,
    ) -> None:
        super().__init__(rank, size)
        self._inner = inner
        self._global_ranks = list(global_ranks)
        self._topology = topology
        self._timeout_s = timeout.total_seconds()
        self._group_link = topology.slowest_link(self._global_ranks)
        self._clocks = {"coll": _LinkClock(), "send": _LinkClock(), "recv": _LinkClock()}
        self.record = CollectiveRecord(record_path)
        self.modelled_s = 0.0  # total modelled link time issued on this group
        self._group_name = ""
        self._pending: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._complete_loop, name="labkit-link", daemon=True)
        self._thread.start()
        # Stop the completion thread before interpreter teardown: a thread still inside
        # torch at exit made workers abort (see DESIGN.md, measured facts).
        weakref.finalize(self, EmulatedProcessGroup._stop_queue, self._pending)

    # -- bookkeeping --------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    # The C++ base keeps a group's name on its backends, and a Python group has none, so
    # `group_name` always raised "ProcessGroup name not set"; pipelining in torch 2.14 reads it.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _get_backend(self, device: Any) -> "EmulatedProcessGroup":
        """A Python process group is its own backend. torch 2.14's `batch_isend_irecv` (used by
        `torch.distributed.pipelining`) asks every group for its backend, and the C++ base
        raises for a Python subclass ("No backend type associated with device type cpu");
        answering with this group keeps every transfer on the modelled link."""
        return self

    @property
    def topology(self) -> Topology:
        return self._topology

    def link_for(self, peer: int | None = None) -> Link:
        if peer is None:
            return self._group_link
        return self._topology.slowest_link([self._global_ranks[self.rank()], self._global_ranks[peer]])

    @staticmethod
    def _stop_queue(q: queue.Queue) -> None:
        q.put(None)

    def close(self) -> None:
        """Finish the completion thread; called by the launcher before a worker exits."""
        if not self._closed:
            self._closed = True
            self._pending.put(None)
            self._thread.join(timeout=self._timeout_s + 5)

    def _complete_loop(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            inner_work, done_at, fut, seq, after_inner, result = item
            try:
                inner_work.wait()
                finished = time.perf_counter()
                if after_inner is not None:
                    done_at = max(done_at, finished + after_inner)
                delay = done_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                self.record.completed(seq)
                # DDP's reducer reads the reduced bucket from the future, as it does from
                # gloo's and NCCL's works: the result must be the list of output tensors.
                fut.set_result(result)
            except Exception as exc:  # the gloo error (timeout, peer gone) reaches the waiter
                fut.set_exception(exc)
            # Drop this thread's references now: otherwise the last bucket stays alive (and
            # counted by a memory budget) until the next collective arrives.
            del item, inner_work, fut, result

    def _later(
        self,
        start: Callable[[], Any],
        op: str,
        tensors: list[torch.Tensor],
        nbytes: int,
        peer: int | None = None,
        result: list[torch.Tensor] | None = None,
    ):
        """Start the gloo transfer; return work that completes when it is done and the
        modelled time has passed. The record is written first, so that a rank which gloo
        aborts inside `start()` still shows what it was doing.

        Known simplification: the modelled time counts from this rank's issue (or the end of
        the previous transfer on the link). A rank that waits for a late peer finishes when
        gloo does, i.e. at the peer's arrival plus the real loopback transfer, not plus the
        modelled one, so a straggler's cost to its peers is slightly understated."""
        seq = self.record.issued(op, tensors, peer)
        inner_work = start()
        n = self.size()
        if peer is None:
            seconds = collective_time_s(op, nbytes, n, self._group_link)
            clock = self._clocks["coll"]
        else:
            seconds = collective_time_s(op, nbytes, 2, self.link_for(peer))
            clock = self._clocks[op]
        self.modelled_s += seconds
        now = time.perf_counter()
        done_at = clock.reserve(now, seconds)
        # A receive cannot finish before its data has crossed the link after the send began;
        # gloo finishing tells us the sender has started, so the model's time is added after it.
        after_inner = seconds if op == "recv" else None
        fut: torch.futures.Future = torch.futures.Future()
        self._pending.put((inner_work, done_at, fut, seq, after_inner, tensors if result is None else result))
        return _ModelledWork(fut)

    # -- collectives (each forwards to gloo, then models the link) ---------------

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._later(
            lambda: self._inner.allreduce(tensors, opts), "all_reduce", tensors, _nbytes(tensors)
        )

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._later(
            lambda: self._inner.allreduce_coalesced(tensors, opts), "all_reduce", tensors, _nbytes(tensors)
        )

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._later(
            lambda: self._inner.broadcast(tensors, opts), "broadcast", tensors, _nbytes(tensors)
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._later(
            lambda: self._inner.allgather(output_tensors, input_tensors, opts),
            "all_gather",
            input_tensors,
            _nbytes(input_tensors) * self.size(),
            result=output_tensors,
        )

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._later(
            lambda: self._inner._allgather_base(output, input, opts),
            "all_gather",
            [input],
            _nbytes([output]),
            result=[output],
        )

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._later(
            lambda: _AllWork([self._inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]),
            "all_gather",
            inputs,
            _nbytes(outputs),
            result=outputs,
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._later(
            lambda: self._inner.reduce_scatter(output_tensors, input_tensors, opts),
            "reduce_scatter",
            output_tensors,
            _nbytes(output_tensors) * self.size(),
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._later(
            lambda: self._inner._reduce_scatter_base(output, input, opts),
            "reduce_scatter",
            [output],
            _nbytes([input]),
            result=[output],
        )

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._later(
            lambda: _AllWork([self._inner._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]),
            "reduce_scatter",
            outputs,
            _nbytes(inputs),
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._later(
            lambda: self._inner.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            "all_to_all",
            [input],
            _nbytes([input]),
            result=[output],
        )

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._later(lambda: self._inner.reduce(tensors, opts), "reduce", tensors, _nbytes(tensors))

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        return self._later(
            lambda: self._inner.gather(output_tensors, input_tensors, opts),
            "gather",
            input_tensors,
            _nbytes(input_tensors) * self.size(),
            result=input_tensors,
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._later(
            lambda: self._inner.scatter(output_tensors, input_tensors, opts),
            "scatter",
            output_tensors,
            _nbytes(output_tensors) * self.size(),
        )

    def send(self, tensors, dst, tag=0):
        return self._later(
            lambda: self._inner.send(tensors, dst, tag), "send", tensors, _nbytes(tensors), peer=dst
        )

    def recv(self, tensors, src, tag=0):
        return self._later(
            lambda: self._inner.recv(tensors, src, tag), "recv", tensors, _nbytes(tensors), peer=src
        )

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._later(lambda: self._inner.barrier(opts), "barrier", [], 0)


class _ModelledWork(dist.Work):
    """Work that ends when the link model says; `wait()` raises the transfer's error.

    (Work made by `_create_work_from_future` returns from `wait()` even when its future
    failed, which turned a peer that never joined a collective into a silent wrong result.)
    """

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()  # re-raises the exception set by the completion thread
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
            return True
        except Exception:
            return False

    def get_future(self) -> torch.futures.Future:
        return self._fut


class _AllWork:
    """Waits for several gloo works, for the coalesced collectives."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True


def _create_emulated_pg(opts, backend_options) -> EmulatedProcessGroup:
    """Backend creator registered with torch.distributed (extended API: gets global ranks)."""
    topology = topology_from_env()
    inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    record_dir = os.environ.get(RECORD_DIR_ENV)
    path = None
    if record_dir and ranks == list(range(int(os.environ.get("WORLD_SIZE", opts.group_size)))):
        path = os.path.join(record_dir, f"record{opts.group_rank}.json")  # the world group only
    pg = EmulatedProcessGroup(inner, opts.group_rank, opts.group_size, ranks, topology, opts.timeout, path)
    pg._set_group_name(opts.group_id)  # torch returns a Python group as it is, before naming it
    return pg


def register_backend() -> str:
    """Register the emulated backend with torch.distributed once per process; return its name."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_emulated_pg, extended_api=True, devices=["cpu"])
    return BACKEND_NAME


TOPOLOGY_ENV = "LABKIT_TOPOLOGY"
RECORD_DIR_ENV = "LABKIT_RECORD_DIR"


def topology_to_env(topology: Topology) -> str:
    import json

    return json.dumps(
        {
            "gpus_per_node": topology.gpus_per_node,
            "intra_node": topology.intra_node.to_dict(),
            "inter_node": topology.inter_node.to_dict(),
        }
    )


def topology_from_env() -> Topology:
    import json

    raw = os.environ.get(TOPOLOGY_ENV)
    if not raw:
        raise RuntimeError(
            f"the {BACKEND_NAME} backend needs ${TOPOLOGY_ENV}; start ranks with labkit.launch(...)"
        )
    d = json.loads(raw)
    return Topology(d["gpus_per_node"], Link(**d["intra_node"]), Link(**d["inter_node"]))


def close_groups() -> None:
    """Stop the completion threads of every emulated group in this process."""
    if not dist.is_initialized():
        return
    for pg in list(dist.distributed_c10d._world.pg_map):
        if isinstance(pg, EmulatedProcessGroup):
            pg.close()


# ------------------------------------------------------------------ memory budget


def _fmt(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


class MemoryBudget(TorchDispatchMode):
    """Track live tensor bytes on this rank and raise OOM past `limit_bytes`.

    Every tensor an operator returns while the mode is active is counted once per storage
    until that storage is freed (a weakref finaliser). Tensors that existed before the
    mode started can be counted with `track(...)`. The check runs when an operator returns,
    so the failed allocation briefly exists in host memory; the lesson (which allocation
    tipped the rank over, and how much was in use) is the same as on a GPU.
    """

    def __init__(self, limit_bytes: int, *, rank: int = 0, device_name: str = "emulated GPU") -> None:
        super().__init__()
        if limit_bytes <= 0:
            raise ValueError(f"memory budget limit_bytes={limit_bytes} must be > 0")
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
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def active_budget() -> MemoryBudget | None:
    """The innermost MemoryBudget active on this thread, if any."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryBudget):
            return mode
    return None


def memory_allocated(device: torch.device | str | None = None) -> int:
    """Bytes in live tensors: CUDA's allocator on a GPU, the emulated budget on CPU."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    budget = active_budget()
    return budget.allocated if budget is not None else 0


def max_memory_allocated(device: torch.device | str | None = None) -> int:
    """Peak bytes in live tensors since the last reset (see `reset_peak_memory_stats`)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    budget = active_budget()
    return budget.peak if budget is not None else 0


def reset_peak_memory_stats(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    budget = active_budget()
    if budget is not None:
        budget.reset_peak()
