"""The emulated interconnect: a gloo process group whose collectives take a GPU link's time.

`EmulatedProcessGroup` wraps a real `ProcessGroupGloo`. Every collective does the real gloo
transfer (numerics stay real) and its work completes no earlier than the α-β model of
`labkit.links` says it would on a GPU node. On a simulated machine (`Cluster.simulated()`) a
collective on FakeTensors moves no data (there is none) and takes the same modelled time; real
tensors still move. Asynchronous collectives complete on a background thread, so overlap with
compute is real overlap. The group is registered as the torch.distributed backend
"labkit_emulated"; `labkit.machine.runtime` initialises it on each rank of an emulated cluster. Its
collective record is `record.py`, the memory budget `budget.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from labkit.links import Link, Topology, collective_time_s
from labkit.machine import _torch_compat as compat
from labkit.machine.emulate.alike import ALIKE_ENV, AlikePeers, AlikeTiming
from labkit.machine.emulate.clock import CLOCK_ENV, rank_clock
from labkit.machine.emulate.record import CollectiveRecord
from labkit.machine.emulate.simulated_device import active_simulated_device
from labkit.machine.emulate.timing import VirtualTiming, WallTiming, called_by_ddp_reducer, caller_frame

__all__ = [
    "BACKEND_NAME",
    "EmulatedProcessGroup",
    "close_groups",
    "register_backend",
    "wait_at_end_of_backward",
]

BACKEND_NAME = "labkit_emulated"
TOPOLOGY_ENV = "LABKIT_TOPOLOGY"
RECORD_DIR_ENV = "LABKIT_RECORD_DIR"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class EmulatedProcessGroup(dist.ProcessGroup):
    """A gloo process group whose collectives take the modelled time of a GPU interconnect.

    Each call forwards to the wrapped `ProcessGroupGloo` (the data really moves), then a
    completion thread finishes the returned work once the gloo transfer is done, with the
    completion time that `timing` gives (`timing.py`): on the ranks' virtual clocks by
    default, or on the wall clock.
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
        timing: VirtualTiming | WallTiming | None = None,
    ) -> None:
        super().__init__(rank, size)
        self.timing = timing if timing is not None else WallTiming()
        self._inner = inner
        self._global_ranks = list(global_ranks)
        self._topology = topology
        self._timeout_s = timeout.total_seconds()
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

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # The C++ base keeps a group's name on its backends, and a Python group has none, so
    # `group_name` always raised "ProcessGroup name not set"; pipelining in torch 2.14 reads it.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _get_backend(self, device: Any) -> EmulatedProcessGroup:
        """A Python process group is its own backend. torch 2.14's `batch_isend_irecv` (used by
        `torch.distributed.pipelining`) asks every group for its backend, and the C++ base
        raises for a Python subclass ("No backend type associated with device type cpu");
        answering with this group keeps every transfer on the modelled link."""
        return self

    @property
    def topology(self) -> Topology:
        return self._topology

    def link_for(self, peer: int) -> Link:
        """The link a point-to-point transfer to `peer` takes (across nodes, one port)."""
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
            inner_work, token, work, seq, result = item
            fut = work.get_future()
            try:
                inner_work.wait()
                work.done_at = self.timing.complete(token)
                self.record.completed(seq)
                # DDP's reducer reads the reduced bucket from the future, as it does from
                # gloo's and NCCL's works: the result must be the list of output tensors.
                fut.set_result(result)
            except Exception as exc:  # the gloo error (timeout, peer gone) reaches the waiter
                fut.set_exception(exc)
            # Drop this thread's references now: otherwise the last bucket stays alive (and
            # counted by a memory budget) until the next collective arrives.
            del item, inner_work, work, fut, result

    def _later(
        self,
        start: Callable[[], Any],
        op: str,
        tensors: list[torch.Tensor],
        nbytes: int,
        peer: int | None = None,
        result: list[torch.Tensor] | None = None,
    ):
        """Start the gloo transfer; return work that completes when it is done, at the time
        `self.timing` gives. The record is written first, so that a rank which gloo aborts
        inside `start()` still shows what it was doing."""
        virtual = self.timing.virtual
        with self.timing.clock.paused() if virtual else contextlib.nullcontext():  # bookkeeping, not compute
            seq = self.record.issued(op, tensors, peer)
            # Rings over the rails across nodes; NVLS left out (as NCCL_NVLS_ENABLE=0): with it, the small
            # all-reduces of lab 03's per-tensor loop lose the ring's fixed cost, which this model, having no
            # low-latency protocols, sets too high (measured: after/before 0.93 on 8 simulated H100s)
            if peer is None:
                seconds = self._topology.collective_time_s(op, nbytes, self._global_ranks, nvls=False)
            else:
                seconds = collective_time_s(op, nbytes, 2, self.link_for(peer))
            self.modelled_s += seconds
            token = self.timing.issue(op, seconds, peer, f"{op} #{seq}", nbytes)
            data = tensors if result is None else [*tensors, *result]
            inner_work = _NoTransfer() if any(compat.is_fake(t) for t in data) else start()
            work = _ModelledWork(
                torch.futures.Future(), self.timing if virtual else None, blocks_host=op == "barrier"
            )
            self._pending.put((inner_work, token, work, seq, tensors if result is None else result))
            if virtual and op == "all_reduce" and called_by_ddp_reducer(caller_frame(2)):
                self.timing.wait_at_end_of_backward(work)
        return work

    # -- collectives: each forwards to gloo, then models the link -------------------
    # `nbytes` follows collective_time_s: the buffer of all_reduce / broadcast / reduce, the
    # output of all_gather and gather, the input of reduce_scatter and scatter.

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._later(
            lambda: self._inner.allreduce(tensors, opts), "all_reduce", tensors, _nbytes(tensors)
        )

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._later(
            lambda: self._inner.allreduce_coalesced(tensors, opts), "all_reduce", tensors, _nbytes(tensors)
        )

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._later(
            lambda: self._inner.broadcast(tensors, opts), "broadcast", tensors, _nbytes(tensors)
        )

    def allgather(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._later(
            lambda: self._inner.allgather(outputs, inputs, opts),
            "all_gather",
            inputs,
            _nbytes(inputs) * self.size(),
            result=outputs,
        )

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._later(
            lambda: compat.allgather_base(self._inner, output, input, opts),
            "all_gather",
            [input],
            _nbytes([output]),
            result=[output],
        )

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def _pairwise(self, one: Callable, op: str, outputs, inputs, opts, recorded, nbytes: int):
        """A coalesced all-gather or reduce-scatter: `one(gloo, output, input, opts)` on each pair."""

        def start() -> _AllWork:
            return _AllWork([one(self._inner, o, i, opts) for o, i in zip(outputs, inputs)])

        return self._later(start, op, recorded, nbytes, result=outputs)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._pairwise(
            compat.allgather_base, "all_gather", outputs, inputs, opts, inputs, _nbytes(outputs)
        )

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._later(
            lambda: self._inner.reduce_scatter(outputs, inputs, opts),
            "reduce_scatter",
            outputs,
            _nbytes(outputs) * self.size(),
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._later(
            lambda: compat.reduce_scatter_base(self._inner, output, input, opts),
            "reduce_scatter",
            [output],
            _nbytes([input]),
            result=[output],
        )

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._pairwise(
            compat.reduce_scatter_base, "reduce_scatter", outputs, inputs, opts, outputs, _nbytes(inputs)
        )

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
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
        opts = opts or dist.ReduceOptions()
        return self._later(lambda: self._inner.reduce(tensors, opts), "reduce", tensors, _nbytes(tensors))

    def gather(self, outputs, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        return self._later(
            lambda: self._inner.gather(outputs, inputs, opts),
            "gather",
            inputs,
            _nbytes(inputs) * self.size(),
            result=inputs,
        )

    def scatter(self, outputs, inputs, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._later(
            lambda: self._inner.scatter(outputs, inputs, opts),
            "scatter",
            outputs,
            _nbytes(outputs) * self.size(),
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
        opts = opts or dist.BarrierOptions()
        return self._later(lambda: self._inner.barrier(opts), "barrier", [], 0)


class _ModelledWork(dist.Work):
    """Work that ends when the link model says; `wait()` raises the transfer's error.

    On the virtual clock `wait()` also moves this rank's clock to the completion time.
    (Work made by `_create_work_from_future` returns from `wait()` even when its future
    failed, which turned a peer that never joined a collective into a silent wrong result.)
    """

    def __init__(
        self, fut: torch.futures.Future, timing: VirtualTiming | None = None, blocks_host: bool = False
    ) -> None:
        super().__init__()
        self._fut = fut
        self.timing = timing  # None on the wall clock
        self.done_at: float | None = None  # virtual completion time, set before the future completes
        # A barrier's wait blocks the host until the device is done, as NCCL's does (WorkNCCL::synchronize
        # with a barrier tensor, ProcessGroupNCCL.cpp); another collective's wait only orders the streams.
        self.blocks_host = blocks_host

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.timing is None:
            self._fut.wait()  # re-raises the exception set by the completion thread
            return True
        with self.timing.clock.paused():  # what blocking costs the CPU is not compute
            self._fut.wait()
        self.timing.clock.advance_to(self.done_at)  # waiting costs virtual time
        simulated = active_simulated_device() if self.blocks_host else None
        if simulated is not None:  # the host, blocked until now, issues the next operator from here
            simulated.synchronize()
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


class _NoTransfer:
    """The transfer of a collective on tensors without storage: nothing to move, done at once."""

    def wait(self) -> bool:
        return True


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
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    record_dir = os.environ.get(RECORD_DIR_ENV)
    path = None
    if record_dir and ranks == list(range(int(os.environ.get("WORLD_SIZE", opts.group_size)))):
        path = os.path.join(record_dir, f"record{opts.group_rank}.json")  # the world group only
    inner: Any
    if os.environ.get(ALIKE_ENV):  # one process stands for alike ranks (alike.py): no peer to meet
        inner, timing = AlikePeers(opts.group_rank, opts.group_size), AlikeTiming(rank_clock())
    else:
        inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        timing = (
            VirtualTiming(opts.store, opts.group_rank, opts.group_size, rank_clock())
            if os.environ.get(CLOCK_ENV, "virtual") in ("virtual", "simulated")
            else WallTiming()
        )
    pg = EmulatedProcessGroup(
        inner, opts.group_rank, opts.group_size, ranks, topology, opts.timeout, path, timing
    )
    pg._set_group_name(opts.group_id)  # torch returns a Python group as it is, before naming it
    return pg


def register_backend() -> str:
    """Register the emulated backend with torch.distributed once per process; return its name."""
    if not compat.backend_registered(BACKEND_NAME):
        dist.Backend.register_backend(BACKEND_NAME, _create_emulated_pg, extended_api=True, devices=["cpu"])
    return BACKEND_NAME


def topology_to_env(topology: Topology) -> str:
    return json.dumps(topology.to_dict())


def topology_from_env() -> Topology:
    raw = os.environ.get(TOPOLOGY_ENV)
    if not raw:
        raise RuntimeError(
            f"the {BACKEND_NAME} backend needs ${TOPOLOGY_ENV}; start ranks with labkit.launch(...)"
        )
    return Topology.from_dict(json.loads(raw))


def wait_at_end_of_backward(work: Any) -> None:
    """For a DDP comm hook's collective: DDP waits for the hook's future in C++ at the end of
    backward, where the virtual clock cannot see it; move the rank's clock to `work`'s
    completion when backward ends. Does nothing on the wall clock or for other works."""
    if isinstance(work, _ModelledWork) and work.timing is not None:
        work.timing.wait_at_end_of_backward(work)


def close_groups() -> None:
    """Stop the completion threads of every emulated group in this process."""
    if not dist.is_initialized():
        return
    for pg in compat.process_groups():
        if isinstance(pg, EmulatedProcessGroup):
            pg.close()
