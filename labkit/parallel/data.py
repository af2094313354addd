"""Data parallelism: gradients averaged over ranks, the naive way, the overlapped way, and accumulation.

The mistake (lab 03): wait for backward to finish, then all-reduce every gradient one at a
time (`allreduce_gradients_naive`). Communication and computation never overlap, and every
small tensor pays the latency of a collective.

The fix is what torch DDP does (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB, sections 3.2.3-3.2.4): put gradients in
buckets of about 25 MB, in the order backward produces them (roughly the reverse of the
forward order), and launch an asynchronous all-reduce on a bucket as soon as its last
gradient is ready, while backward goes on computing the gradients of earlier layers.
`OverlappedDDP` is that idea in about a hundred lines, with two small methods that the lab
asks you to write: the gradient hook (`on_grad_ready`) and the bucket flush (`flush`).
Every collective is logged in a `labkit.trace.CommLog`, so `labkit.trace.capture` can show
when each one was issued and when it completed.

Gradient accumulation (lab 02): `accumulate_with_no_sync` runs every micro-step but the last
under `no_sync()`, so a DDP model all-reduces once per optimizer step;
`accumulate_without_no_sync` is the silent mistake that all-reduces after every micro-step.

Process groups are passed explicitly (`process_group=None` is the default group). The lab
drivers that time these are in `labkit.course.experiments`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from labkit import validate
from labkit.machine import runtime
from labkit.trace.commlog import CommLog

__all__ = [
    "OverlappedDDP",
    "accumulate_with_no_sync",
    "accumulate_without_no_sync",
    "allreduce_gradients_naive",
    "make_ddp",
]


# ------------------------------------------------------------------- the mistake


def allreduce_gradients_naive(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    comm_log: CommLog | None = None,
) -> int:
    """THE MISTAKE: after backward, all-reduce each gradient one by one, synchronously.

    Averages gradients over the group (sum, then divide by world size). A trainable
    parameter with no gradient gets zeros, so every rank issues the same collectives.
    Returns the number of collectives launched (one per parameter).
    """
    world = dist.get_world_size(process_group)
    count = 0
    for p in module.parameters():  # parameters() yields a tied Parameter once
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter_ns()
        with record_function("comm:all_reduce"):
            # synchronous: gloo returns when it is done; NCCL when it is enqueued, the stream orders the rest
            dist.all_reduce(p.grad, group=process_group)
        if comm_log is not None and not runtime.on_gpu():  # on GPUs the trace's NCCL kernels tell
            nbytes = p.grad.numel() * p.grad.element_size()
            comm_log.add(f"all_reduce param{count}", t0, time.perf_counter_ns(), nbytes)
        p.grad.div_(world)
        count += 1
    return count


# ---------------------------------------------------------------------- the fix


@dataclass
class Bucket:
    """Gradients reduced together: a flat buffer and where each parameter sits in it."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # element offset of each parameter in the flat buffer
    numel: int
    pending: int = 0  # parameters whose gradient is not ready yet in this step
    buffer: torch.Tensor | None = None
    work: Any = None  # the asynchronous all-reduce in flight
    logged: Any = None  # completes once the CommLog holds this bucket's span
    names: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()


class OverlappedDDP(nn.Module):
    """Data parallel wrapper: bucketed gradient all-reduce launched from gradient hooks.

    Use it like torch DDP, plus one explicit call before the optimizer step:

        model = OverlappedDDP(net, bucket_cap_mb=25, process_group=pg)
        loss = loss_fn(model(x), y)
        loss.backward()                         # buckets are all-reduced during backward
        model.finish_gradient_synchronization() # wait for the last ones, average
        optimizer.step()

    Rank 0's parameters and buffers are broadcast first, so all ranks start equal. Buckets hold the
    trainable parameters in reverse registration order (torch DDP's first bucket order, Li et al. 2020
    section 3.2.3), at most `bucket_cap_mb` MiB each, and go out strictly in index order, so every rank
    issues the same collectives in the same order. A parameter used twice (tied weights) is bucketed once.
    One with no gradient in a step holds its bucket back until `finish_gradient_synchronization`, which
    sends zeros for it. Wrap the module after moving it to its device: buckets are laid out at construction.
    The course runs it as `labkit.course.training.overlapped.CourseOverlappedDDP`, which adds checks on a
    hand-written `flush` and hooks that let a dropped wrapper go.
    """

    def __init__(
        self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        validate.positive_number(
            "bucket_cap_mb",
            bucket_cap_mb,
            "25 (MiB, torch DDP's default), or 1e-6 for one bucket per parameter",
        )
        if not dist.is_initialized():
            raise RuntimeError(
                "OverlappedDDP needs an initialised process group; run it inside labkit.launch(...) or after "
                "dist.init_process_group(...)."
            )
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.comm_log = CommLog()  # each collective from issue to completion, for labkit.trace.capture
        self.require_sync = True  # False inside no_sync()
        self.next_bucket = 0  # the next bucket to launch: buckets go in index order
        self.num_collectives = 0  # launched in the last finished step
        self.launched_in_backward = 0  # of those, launched by the hooks while backward ran
        self._launched = 0
        self._broadcast_from_rank0()
        self.buckets = self._assign_buckets()
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = self.register_hooks()

    def _broadcast_from_rank0(self) -> None:
        """Copy rank 0's parameters and buffers to every rank (Li et al. 2020, section 3.2.1)."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:  # a tied parameter once
                flat = t.data.contiguous()
                dist.broadcast(flat, src=src, group=self.process_group)
                if flat is not t.data:
                    t.data.copy_(flat)

    def _assign_buckets(self) -> list[Bucket]:
        """The trainable parameters (a tied one once), last registered first, cut into buckets of one dtype
        and device."""
        named = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        named.reverse()  # gradients of the last layers are ready first
        buckets: list[Bucket] = []
        current: list[tuple[str, nn.Parameter]] = []
        size = 0
        for name, p in named:
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (p.dtype, p.device) == (current[0][1].dtype, current[0][1].device)
            if current and (size + nbytes > self.bucket_cap_bytes or not same_kind):
                buckets.append(_bucket(len(buckets), current))
                current, size = [], 0
            current.append((name, p))
            size += nbytes
        if current:
            buckets.append(_bucket(len(buckets), current))
        return buckets

    def register_hooks(self) -> list[Any]:
        """Call `on_grad_ready(p)` once autograd has accumulated each parameter's gradient."""
        params = [p for b in self.buckets for p in b.params]
        return [p.register_post_accumulate_grad_hook(self.on_grad_ready) for p in params]

    # EXERCISE PART 1: the hook. Called by autograd once a parameter's .grad holds its
    # final value for this backward (register_post_accumulate_grad_hook). Mark the
    # parameter ready; when its bucket is complete, launch every complete bucket in order.
    def on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return  # inside no_sync(): gradients only accumulate locally
        bucket = self.bucket_of[id(param)]
        bucket.pending -= 1
        # Launch in index order only: a collective issued out of order on one rank would be
        # matched with a different bucket on another rank.
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.flush(self.buckets[self.next_bucket])
            self.next_bucket += 1

    # EXERCISE PART 2: the bucket flush. Copy the bucket's gradients into one flat buffer
    # and start an asynchronous all-reduce on it; backward goes on while it runs.
    def flush(self, bucket: Bucket) -> None:
        first = bucket.params[0]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        for p, off in zip(bucket.params, bucket.offsets):
            view = bucket.buffer[off : off + p.numel()]
            if p.grad is None:
                view.zero_()  # unused in this step: contribute nothing, but take part
            else:
                view.copy_(p.grad.reshape(-1))
        t0 = time.perf_counter_ns()
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        self.after_launch(bucket, t0)

    def after_launch(self, bucket: Bucket, start_ns: int) -> None:
        """Bookkeeping, not the algorithm: count the collective and log it for traces."""
        name = f"all_reduce bucket{bucket.index}"
        bucket.logged = self.comm_log.track(bucket.work, name, bucket.nbytes, start_ns=start_ns)
        self._launched += 1

    def finish_gradient_synchronization(self) -> None:
        """Flush the buckets still waiting (unused parameters), wait for all, average, copy back.

        Call after backward and before `optimizer.step()`; it resets the state for the next step.
        """
        self.launched_in_backward = self._launched
        while self.next_bucket < len(self.buckets):  # the same order on every rank
            self.flush(self.buckets[self.next_bucket])
            self.next_bucket += 1
        with record_function("comm:wait"):
            for bucket in self.buckets:
                bucket.work.wait()
                if bucket.logged is not None:
                    bucket.logged.wait()
        for bucket in self.buckets:
            bucket.buffer.div_(self.world_size)  # sum -> mean
            for p, off in zip(bucket.params, bucket.offsets):
                avg = bucket.buffer[off : off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
            bucket.work = bucket.logged = None
            bucket.pending = len(bucket.params)
        self.num_collectives, self._launched, self.next_bucket = self._launched, 0, 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally; the next synced backward sends the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _bucket(index: int, named: list[tuple[str, nn.Parameter]]) -> Bucket:
    """Bucket `index` of these parameters, each at its offset in the flat buffer."""
    params = [p for _, p in named]
    offsets = [sum(q.numel() for q in params[:i]) for i in range(len(params))]
    numel = sum(p.numel() for p in params)
    return Bucket(index, params, offsets, numel, pending=len(params), names=[name for name, _ in named])


# ------------------------------------------------------------------ torch's own


def make_ddp(
    module: nn.Module,
    *,
    bucket_cap_mb: float = 25.0,
    process_group: dist.ProcessGroup | None = None,
    gradient_as_bucket_view: bool = True,
) -> DistributedDataParallel:
    """torch's `DistributedDataParallel` around `module`, as every lab builds it.

    On a GPU `device_ids` is the rank's one device (the module must be on it); on the CPU it is None, as DDP
    requires. `gradient_as_bucket_view=True` lets the gradients live in DDP's buckets instead of beside them
    (one gradient copy less; PyTorch DDP docs); zero them with `zero_grad(set_to_none=False)`, which keeps the
    views.
    """
    validate.positive_number("bucket_cap_mb", bucket_cap_mb, "25 (MiB, DDP's default)")
    if runtime.on_simulated():
        raise RuntimeError(
            "torch's DistributedDataParallel cannot run on a simulated machine: its C++ constructor and "
            "reducer read the parameters' storage (the broadcast from rank 0, the gradient buckets), and "
            "FakeTensors have none (torch says 'its data is not allocated yet'). Use labkit's Python "
            "equivalent there: "
            f"OverlappedDDP(module, bucket_cap_mb={bucket_cap_mb:g}) (TrainingJob(grad_sync='overlapped')), "
            "which buckets the gradients and all-reduces them from gradient hooks, as DDP does."
        )
    dev = runtime.device()
    return DistributedDataParallel(
        module,
        device_ids=[dev.index] if dev.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        process_group=process_group,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )


# ---------------------------------------------------------- gradient accumulation


def accumulate_with_no_sync(ddp: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Sum the gradients of ``mean loss / len(batches)`` over the micro-batches; one all-reduce.

    Every micro-step but the last runs inside ``ddp.no_sync()``, so DDP only accumulates the
    local gradients; the last backward all-reduces the sum, bucket by bucket (PyTorch docs,
    ``DistributedDataParallel.no_sync``).
    """
    n = len(batches)
    for x, y in batches[:-1]:
        with ddp.no_sync():
            (ddp(x, y) / n).backward()
    x, y = batches[-1]
    (ddp(x, y) / n).backward()


def accumulate_without_no_sync(ddp: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The silent mistake: the same gradients, but DDP all-reduces after every micro-step."""
    n = len(batches)
    for x, y in batches:
        (ddp(x, y) / n).backward()
