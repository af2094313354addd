"""How a training job averages its gradients over the ranks: one class per `TrainingJob.grad_sync`.

Each wraps the model (`module`: what the forward runs through), keeps the micro-steps of gradient
accumulation local (`no_sync()`), finishes the step's communication after backward (`after_backward()`),
and counts what it issued in the last step: `collectives`, and `in_backward`, those launched before backward
returned (the overlap lab 03 measures):

* `NoSync` ("none"): compute alone, nothing averaged;
* `PerTensor` ("per_tensor", the mistake): `allreduce_gradients_naive` after backward, one collective per
  gradient, none during backward;
* `Overlapped` ("overlapped"): labkit's `OverlappedDDP` as the course runs it (`CourseOverlappedDDP`), or
  a learner's subclass, buckets launched from gradient hooks during backward;
* `TorchDDP` ("ddp"): torch's DDP (`labkit.parallel.data.make_ddp`) with a comm hook that does DDP's default
  all-reduce and counts it (`CountingAllReduce`).

`communicate_only()` issues the same collectives with zero gradients and no compute: communication alone.
With a `CommLog`, every collective is logged in it from issue to completion, for a host trace's communication
lane (on the CPU; on GPUs the trace's NCCL kernels tell).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.course.training.overlapped import CourseOverlappedDDP
from labkit.machine import emulate, runtime
from labkit.parallel.data import OverlappedDDP, allreduce_gradients_naive, make_ddp
from labkit.trace.commlog import CommLog

__all__ = ["CountingAllReduce", "GradSync", "NoSync", "Overlapped", "PerTensor", "TorchDDP", "make_grad_sync"]


class GradSync:
    """No averaging (the base of the others, and "none")."""

    def __init__(
        self,
        model: nn.Module,
        process_group: dist.ProcessGroup | None,
        log: CommLog | None,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.model, self.process_group, self.log = model, process_group, log
        self.bucket_cap_mb = bucket_cap_mb  # for the bucketed ones (DDP's default is 25)
        self.collectives = 0  # issued in the last step
        self.in_backward = 0  # of those, launched before backward returned
        self.module: nn.Module = self.wrap(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        """What the forward runs through: the model itself, or a DDP around it."""
        return model

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around a micro-step whose gradients stay local (accumulation)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around `loss.backward()` of the step's last micro-batch."""
        yield

    def after_backward(self) -> None:
        """The step's communication after backward; the gradients are averaged when it returns."""

    def communicate_only(self) -> None:
        """The collectives of a step with zero gradients and no compute (communication alone)."""
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.after_backward()


NoSync = GradSync


class PerTensor(GradSync):
    """THE MISTAKE: each gradient all-reduced on its own, after backward."""

    def after_backward(self) -> None:
        self.collectives = allreduce_gradients_naive(self.model, self.process_group, comm_log=self.log)
        self.in_backward = 0  # by construction


class Overlapped(GradSync):
    """`OverlappedDDP` (or `ddp_class`, a subclass): buckets all-reduced from gradient hooks during
    backward."""

    def __init__(
        self, *args: Any, ddp_class: type[OverlappedDDP] = CourseOverlappedDDP, **kwargs: Any
    ) -> None:
        self.ddp_class = ddp_class  # read by wrap(), which GradSync's constructor calls
        super().__init__(*args, **kwargs)

    def wrap(self, model: nn.Module) -> nn.Module:
        self.ddp = self.ddp_class(model, bucket_cap_mb=self.bucket_cap_mb, process_group=self.process_group)
        if self.log is not None:
            self.ddp.comm_log = self.log
        return self.ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    def after_backward(self) -> None:
        self.ddp.finish_gradient_synchronization()
        self.collectives, self.in_backward = self.ddp.num_collectives, self.ddp.launched_in_backward

    @property
    def calls(self) -> list[tuple[int, int]]:
        """(bucket index, bytes) of the last step's all-reduces, one per bucket, as TorchDDP's counter lists
        them."""
        return [(b.index, b.nbytes) for b in self.ddp.buckets] if self.collectives else []

    def communicate_only(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.ddp.finish_gradient_synchronization()  # no hook fired: every bucket goes now
        self.collectives, self.in_backward = self.ddp.num_collectives, 0


class CountingAllReduce:
    """A DDP comm hook that does DDP's default (average, then all-reduce the bucket) and counts it.

        counter = CountingAllReduce(group, log=comm_log)
        ddp.register_comm_hook(counter, CountingAllReduce.hook)

    `calls` lists (bucket index, bytes) of every all-reduce; `in_backward` counts those launched
    while `backward_running` was set; with a `CommLog` each is logged from issue to completion.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, log: CommLog | None = None) -> None:
        self.process_group = process_group
        self.log = log
        self.calls: list[tuple[int, int]] = []
        self.in_backward = 0
        self.backward_running = False

    @staticmethod
    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own
        buf = bucket.buffer().div_(dist.get_world_size(state.process_group))
        nbytes = buf.numel() * buf.element_size()
        state.calls.append((bucket.index(), nbytes))
        state.in_backward += state.backward_running
        t0 = time.perf_counter_ns()
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)
        emulate.wait_at_end_of_backward(work)  # DDP waits for the hook's future in C++ (virtual clock)
        logged = None
        if state.log is not None:
            logged = state.log.track(work, f"all_reduce ddp_bucket{bucket.index()}", nbytes, start_ns=t0)
        fut = work.get_future() if logged is None else logged

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            f.wait()  # re-raise a failed collective's error
            return buf

        return fut.then(reduced)

    def clear(self) -> None:
        self.calls.clear()
        self.in_backward = 0


class TorchDDP(GradSync):
    """torch's DDP, its bucket all-reduces counted (DDP launches them from its own hooks during backward)."""

    def wrap(self, model: nn.Module) -> nn.Module:
        self.ddp = make_ddp(model, bucket_cap_mb=self.bucket_cap_mb, process_group=self.process_group)
        self.counter = CountingAllReduce(self.process_group, log=self.log)
        self.ddp.register_comm_hook(self.counter, CountingAllReduce.hook)
        self.calls: list[tuple[int, int]] = []  # (bucket index, bytes) of the last step's all-reduces
        return self.ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.counter.backward_running = True
        try:
            yield
        finally:
            self.counter.backward_running = False

    def after_backward(self) -> None:
        # DDP's reducer has waited for every bucket before backward returned
        self.calls = list(self.counter.calls)
        self.collectives, self.in_backward = len(self.calls), self.counter.in_backward
        self.counter.clear()

    def communicate_only(self) -> None:
        raise ValueError("communication alone is measured for per_tensor and overlapped, not torch DDP")


def make_grad_sync(
    kind: str,
    model: nn.Module,
    process_group: dist.ProcessGroup | None,
    log: CommLog | None,
    bucket_cap_mb: float,
    ddp_class: type[OverlappedDDP] | None = None,
) -> GradSync:
    """The `GradSync` of `TrainingJob.grad_sync` `kind` around `model`. On a simulated machine "ddp" is
    labkit's `OverlappedDDP`: torch DDP's C++ reducer reads storage, which FakeTensors lack
    (`labkit.parallel.data.make_ddp` says so); both bucket the gradients and all-reduce them from hooks."""
    if kind == "ddp" and runtime.on_simulated():
        kind = "overlapped"
    if kind == "per_tensor":
        return PerTensor(model, process_group, log)
    if kind == "overlapped":
        chosen = ddp_class or CourseOverlappedDDP
        return Overlapped(model, process_group, log, bucket_cap_mb, ddp_class=chosen)
    if kind == "ddp":
        return TorchDDP(model, process_group, log, bucket_cap_mb)
    return NoSync(model, process_group, log)
