"""Alike ranks on a simulated cluster: one process stands for ranks that all run the same operators.

On a simulated machine (`Cluster.simulated()`) a rank's tensors have no storage and its time is its
operators' modelled time, so the ranks of data parallelism, and of tensor parallelism on a node whose links
are alike, do the same work at the same virtual moments: running them all repeats one computation N times
(lab 01's two simulated nodes: 4 processes for one answer, 16 at the defaults). `labkit.launch(...,
alike=True)` starts rank 0 alone in a world of N ranks:

* `AlikePeers` stands where the group's gloo transfer would be. For the few real tensors still sent (pickled
  objects, a loss), it computes what the collective would give if every peer held what rank 0 holds: a sum is
  N times the value, a maximum the value itself, an all-gather N copies.
* `AlikeTiming` starts each collective when rank 0 issues it (every peer issues it at that moment too) and
  the group's previous one has finished; its duration is the link model's, as with `VirtualTiming`.
* Point-to-point transfers raise: a pipeline's stages do different work, so they are not alike.

The result, the times, the bytes and the peak memory are those of N processes (tests/machine/emulate/
test_alike.py compares them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from labkit.machine.emulate.clock import VirtualClock
from labkit.machine.emulate.timing import VirtualTiming

__all__ = ["ALIKE_ENV", "AlikePeers", "AlikeTiming", "NotAlikeError"]

ALIKE_ENV = "LABKIT_ALIKE_RANKS"  # set ("1") in the one process that stands for all ranks


class NotAlikeError(RuntimeError):
    """An operation whose ranks cannot be alike ran in a launch that said they were."""


def _not_alike(what: str) -> NotAlikeError:
    return NotAlikeError(
        f"{what} in a launch with alike=True: one process stands for every rank there, so a transfer "
        "between two ranks has no peer. A pipeline's stages differ: launch it without alike=True"
    )


class _Done:
    """The work of a transfer done at once (there is no peer to wait for)."""

    def wait(self) -> bool:
        return True


class AlikePeers:
    """What a collective on real tensors gives when every peer of this rank holds the same tensors.

    It has the methods of `ProcessGroupGloo` that `EmulatedProcessGroup` calls, each applied in place at once.
    """

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def _reduce(self, t: torch.Tensor, op: Any) -> None:
        """`t` reduced with `size` equal copies of itself."""
        if op == dist.ReduceOp.SUM:
            t.mul_(self._size)
        elif op == dist.ReduceOp.PRODUCT:
            t.pow_(self._size)
        elif op not in (
            dist.ReduceOp.AVG,
            dist.ReduceOp.MIN,
            dist.ReduceOp.MAX,
            dist.ReduceOp.BAND,
            dist.ReduceOp.BOR,
        ):
            raise _not_alike(f"reduce operation {op}")

    def allreduce(self, tensors, opts):
        for t in tensors:
            self._reduce(t, opts.reduceOp)
        return _Done()

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return _Done()  # every peer already holds the root's tensors

    def allgather(self, outputs, inputs, opts):
        for out_list, t in zip(outputs, inputs):
            for out in out_list:
                out.copy_(t)
        return _Done()

    def _allgather_base(self, output, input, opts):
        output.copy_(torch.cat([input] * self._size))
        return _Done()

    def reduce_scatter(self, outputs, inputs, opts):
        for out, in_list in zip(outputs, inputs):
            out.copy_(in_list[self._rank])
            self._reduce(out, opts.reduceOp)
        return _Done()

    def _reduce_scatter_base(self, output, input, opts):
        output.copy_(input.chunk(self._size)[self._rank])
        self._reduce(output, opts.reduceOp)
        return _Done()

    def reduce(self, tensors, opts):
        if opts.rootRank == self._rank:
            for t in tensors:
                self._reduce(t, opts.reduceOp)
        return _Done()

    def barrier(self, opts):
        return _Done()

    def __getattr__(self, name: str) -> Any:  # all-to-all, gather, scatter, send, recv
        raise _not_alike(f"a {name.lstrip('_')}")


class AlikeTiming(VirtualTiming):
    """`VirtualTiming` where every peer issues each collective when this rank does: no store to meet in."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(None, 0, 1, clock)  # type: ignore[arg-type]  # the store is never asked

    def issue(self, op: str, seconds: float, peer: int | None, name: str = "", nbytes: int = 0) -> tuple:
        if peer is not None:
            raise _not_alike(f"a {op} to or from rank {peer}")
        now = self.clock.device_ready()
        return ("coll", (name or op, now, nbytes), now, seconds)

    def _done(self, token: tuple) -> float:
        _, _, issued, seconds = token
        self._group_busy = max(issued, self._group_busy) + seconds
        return self._group_busy
