"""Gradient all-reduce for data parallel training, the naive way and the overlapped way,
and a bandwidth test in the style of nccl-tests.

The mistake (lab 03): wait for backward to finish, then all-reduce every gradient one at a
time. Communication and computation never overlap, and every small tensor pays the
latency of a collective.

The fix is what torch DDP does (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB, sections 3.2.3-3.2.4): put gradients in
buckets of about 25 MB, in the order backward produces them (roughly the reverse of the
forward order), and launch an asynchronous all-reduce on a bucket as soon as its last
gradient is ready, while backward goes on computing the gradients of earlier layers.

`OverlappedDDP` is that idea in about a hundred lines, with two small methods that the lab
asks you to write: the gradient hook (`_on_grad_ready`) and the bucket flush (`_flush`).
Every collective is logged in a `labkit.trace.CommLog`, so `labkit.trace.capture` can
show when each one was issued and when it completed.

`train_steps` times the mistake, the fix and torch's DistributedDataParallel on the same
ranks, step by step, next to compute alone and communication alone, and checks every step
against a single-process run on the whole batch; `summarize_steps` combines the ranks.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from labkit.trace import CommLog

__all__ = [
    "TRAIN_MODES",
    "OverlappedDDP",
    "allreduce_gradients_naive",
    "bandwidth_test",
    "bus_bandwidth_factor",
    "summarize_steps",
    "train_steps",
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
            dist.all_reduce(p.grad, group=process_group)  # blocks until this one is done
        if comm_log is not None and p.grad.device.type != "cuda":
            nbytes = p.grad.numel() * p.grad.element_size()
            comm_log.add(f"all_reduce param{count}", t0, time.perf_counter_ns(), nbytes)
        p.grad.div_(world)
        count += 1
    return count


# ---------------------------------------------------------------------- the fix


@dataclass
class _Bucket:
    """Gradients reduced together: a flat buffer and where each parameter sits in it."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # element offset of each parameter in the flat buffer
    numel: int
    pending: int = 0  # parameters whose gradient is not ready yet in this step
    buffer: torch.Tensor | None = None
    work: Any = None
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

    * At construction rank 0's parameters and buffers are broadcast, so all ranks start equal.
    * Buckets hold trainable parameters in reverse registration order (torch DDP's initial
      bucket order, Li et al. 2020 section 3.2.3), at most `bucket_cap_mb` MiB each (a
      larger parameter gets a bucket of its own), one dtype and device per bucket.
    * Buckets are launched strictly in index order, so every rank issues the same
      collectives in the same order even when gradients become ready in a different order.
    * Frozen parameters (requires_grad=False) are never bucketed. A Parameter used twice
      (tied embedding and LM head) is bucketed once; autograd accumulates both uses before
      its hook fires. A parameter with no gradient in a step (unused) holds its bucket back
      until `finish_gradient_synchronization`, which flushes what is left with zeros for
      missing gradients: no rank hangs, and that parameter ends the step with a zero
      gradient (torch DDP with find_unused_parameters=True also all-reduces a bitmap to
      leave globally unused gradients at None; we do not).
    * Wrap the module after moving it to its device: buckets are laid out at construction.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb} must be > 0; torch DDP's default is 25 (MiB), "
                "and a tiny value such as 1e-6 gives one bucket per parameter."
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "OverlappedDDP needs an initialised process group; run it inside "
                "labkit.launch.launch(...) or after dist.init_process_group(...)."
            )
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.comm_log = CommLog()
        self.num_collectives = 0  # collectives launched in the last finished step
        self.launched_in_backward = 0  # of those, launched by hooks while backward ran
        self.total_collectives = 0
        self._launched = 0
        self._next_bucket = 0  # the next bucket to launch; buckets go in order
        self._ready: set[int] = set()  # ids of parameters whose gradient is ready this step
        self._require_sync = True

        self._broadcast_from_rank0()
        self.buckets = self._assign_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.pending = len(b.params)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]

    # -- setup -------------------------------------------------------------------

    def _broadcast_from_rank0(self) -> None:
        """Copy rank 0's parameters and buffers to every rank (Li et al. 2020, section 3.2.1)."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        seen: set[int] = set()
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                if id(t) in seen:
                    continue
                seen.add(id(t))
                flat = t.data if t.data.is_contiguous() else t.data.contiguous()
                dist.broadcast(flat, src=src, group=self.process_group)
                if flat is not t.data:
                    t.data.copy_(flat)

    def _assign_buckets(self) -> list[_Bucket]:
        """Trainable parameters, deduplicated by identity, reversed, cut into buckets."""
        names: dict[int, str] = {}
        params: list[nn.Parameter] = []
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if p.requires_grad and id(p) not in names:
                names[id(p)] = name
                params.append(p)
        params.reverse()  # gradients of the last layers are ready first

        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (p.dtype == current[0].dtype and p.device == current[0].device)
            if current and (size + nbytes > self.bucket_cap_bytes or not same_kind):
                buckets.append(self._make_bucket(len(buckets), current, names))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(self._make_bucket(len(buckets), current, names))
        return buckets

    @staticmethod
    def _make_bucket(index: int, params: list[nn.Parameter], names: dict[int, str]) -> _Bucket:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        return _Bucket(index, list(params), offsets, numel, names=[names[id(p)] for p in params])

    # -- the two pieces of the exercise -------------------------------------------

    # EXERCISE PART 1: the hook. Called by autograd once a parameter's .grad holds its
    # final value for this backward (register_post_accumulate_grad_hook). Mark the
    # parameter ready; when its bucket is complete, launch every complete bucket in order.
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._require_sync:
            return  # inside no_sync(): gradients only accumulate locally
        if id(param) in self._ready:
            raise RuntimeError(
                "a parameter's gradient became ready twice before finish_gradient_synchronization(); "
                "call it after every backward, wrap the accumulation backwards in model.no_sync(), or "
                "call remove_hooks() before training the wrapped module without OverlappedDDP."
            )
        self._ready.add(id(param))
        bucket = self._bucket_of[id(param)]
        bucket.pending -= 1
        # Launch in index order only: a collective issued out of order on one rank would be
        # matched with a different bucket on another rank.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._flush(self.buckets[self._next_bucket])
            self._next_bucket += 1

    # EXERCISE PART 2: the bucket flush. Copy the bucket's gradients into one flat buffer
    # and start an asynchronous all-reduce on it; backward goes on while it runs.
    def _flush(self, bucket: _Bucket) -> None:
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
        self._after_launch(bucket, t0)

    def _after_launch(self, bucket: _Bucket, start_ns: int) -> None:
        """Bookkeeping, not part of the algorithm: count the collective, log it for traces."""
        name = f"all_reduce bucket{bucket.index}"
        bucket.logged = self.comm_log.track(
            bucket.work, name, bucket.nbytes, start_ns=start_ns, device=bucket.buffer.device
        )
        self._launched += 1

    # -- the step ------------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Flush buckets still waiting (unused parameters), wait for all, average, copy back.

        Call after backward and before `optimizer.step()`; it resets the state for the next step.
        """
        self.launched_in_backward = self._launched
        while self._next_bucket < len(self.buckets):  # the same order on every rank
            self._flush(self.buckets[self._next_bucket])
            self._next_bucket += 1
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
        self.num_collectives = self._launched
        self.total_collectives += self._launched
        self._launched = 0
        self._next_bucket = 0
        self._ready.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally; the next synced backward sends the sum."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def remove_hooks(self) -> nn.Module:
        """Remove the gradient hooks from the wrapped module's parameters and return it.

        The hooks live on the parameters, so the bare `.module` still triggers them; call
        this before training it without the wrapper (for example with the naive all-reduce).
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        return self.module

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def bucket_summary(self) -> list[dict[str, Any]]:
        """One row per bucket: index, number of parameters, bytes and parameter names."""
        return [
            {"bucket": b.index, "params": len(b.params), "bytes": b.nbytes, "names": list(b.names)}
            for b in self.buckets
        ]


# ------------------------------------------------------------------ bandwidth test


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """busbw / algbw as nccl-tests defines it, so that bus bandwidth is comparable to link speed.

    all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n; broadcast 1
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
    }
    if op not in factors:
        raise ValueError(f"op={op!r} is not supported; choose one of {sorted(factors)}.")
    return factors[op]


def _default_device(process_group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run_collective(
    op: str, full: torch.Tensor, shard: torch.Tensor, src: int, group: dist.ProcessGroup | None
) -> None:
    """One blocking collective; `full` is the nccl-tests "size" buffer, `shard` is full / n."""
    if op == "all_reduce":
        dist.all_reduce(full, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(full, shard, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, full, group=group)
    else:
        dist.broadcast(full, src=src, group=group)
    if full.device.type == "cuda":
        torch.cuda.synchronize(full.device)


def bandwidth_test(
    sizes_bytes: list[int],
    *,
    op: str = "all_reduce",
    iters: int = 5,
    warmup: int = 1,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, Any]]:
    """Time a collective at each size, nccl-tests style; every rank calls it, each gets the rows.

    `size_bytes` follows nccl-tests: the buffer of all_reduce and broadcast, the *output* of
    all_gather and the *input* of reduce_scatter (sizes are rounded down to a multiple of
    world_size elements). Each row: op, size_bytes, world_size, time_ms (median over
    `iters`), algbw_GBps = size / time and busbw_GBps = algbw · bus_bandwidth_factor(op, n).
    """
    if iters < 1 or warmup < 0:
        raise ValueError(
            f"iters={iters}, warmup={warmup}: need iters >= 1 and warmup >= 0; e.g. iters=5, warmup=1."
        )
    n = dist.get_world_size(process_group)
    factor = bus_bandwidth_factor(op, n)
    device = torch.device(device) if device is not None else _default_device(process_group)
    elem = torch.tensor([], dtype=dtype).element_size()
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    rows = []
    for size in sizes_bytes:
        count = (int(size) // elem // n) * n  # elements, a multiple of n
        if count == 0:
            raise ValueError(
                f"size {size} bytes is smaller than world_size({n}) * {elem}-byte elements; "
                f"use sizes >= {n * elem} bytes."
            )
        full = torch.zeros(count, dtype=dtype, device=device)  # zeros: sums never overflow
        shard = torch.zeros(count // n, dtype=dtype, device=device)
        dist.barrier(group=process_group)
        for _ in range(warmup):
            _run_collective(op, full, shard, src, process_group)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            _run_collective(op, full, shard, src, process_group)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        nbytes = count * elem
        algbw = nbytes / seconds / 1e9
        rows.append(
            {
                "op": op,
                "size_bytes": nbytes,
                "world_size": n,
                "time_ms": seconds * 1e3,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * factor,
            }
        )
    dist.barrier(group=process_group)
    return rows


# ------------------------------------------------------- measuring a training step

TRAIN_MODES = ("compute", "comm_naive", "naive", "comm_overlapped", "overlapped", "torch_ddp")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_abs_diff(model: nn.Module, reference: nn.Module) -> float:
    with torch.no_grad():
        return max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
        )


class _Run:
    """One way of doing a data-parallel training step on a private copy of the model."""

    def __init__(self, mode, make_model, lr, bucket_cap_mb, ddp_class, process_group, device):
        self.mode = mode
        self.log = CommLog()
        self.collectives = 0  # in the last step
        self.in_backward: int | None = None  # collectives launched before backward() returned
        self._backward_running = False
        self.buckets: int | None = None
        self.bucket_summary: list[dict[str, Any]] | None = None
        self.module = make_model()
        self.opt = torch.optim.SGD(self.module.parameters(), lr=lr)
        self.wrapped: nn.Module = self.module
        self.group = process_group
        if mode in ("overlapped", "comm_overlapped"):
            self.wrapped = ddp_class(self.module, bucket_cap_mb=bucket_cap_mb, process_group=process_group)
            self.wrapped.comm_log = self.log
            self.buckets = self.wrapped.num_buckets
            self.bucket_summary = self.wrapped.bucket_summary()
        elif mode == "torch_ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(
                self.module, device_ids=ids, bucket_cap_mb=bucket_cap_mb, process_group=process_group
            )
            self.wrapped.register_comm_hook(None, self._ddp_hook)
        if mode.startswith("comm_"):  # gradients to send, without computing any
            for p in self.module.parameters():
                p.grad = torch.zeros_like(p)

    def _ddp_hook(self, state, bucket):  # no annotations: DDP checks them, and ours are strings
        """DDP's default hook (average, then all-reduce the bucket), plus a count and a CommLog span."""
        buf = bucket.buffer().div_(dist.get_world_size(self.group))
        t0 = time.perf_counter_ns()
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        logged = self.log.track(work, f"all_reduce ddp_bucket{bucket.index()}", buf.numel() * buf.element_size(),
                                start_ns=t0, device=buf.device)
        self.collectives += 1
        self.in_backward += self._backward_running
        fut = work.get_future() if logged is None else logged

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            f.wait()  # re-raise a failed collective's error
            return buf

        return fut.then(reduced)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        mode = self.mode
        if mode == "comm_naive":
            self.collectives = allreduce_gradients_naive(self.module, self.group, comm_log=self.log)
            return
        if mode == "comm_overlapped":
            self.wrapped.finish_gradient_synchronization()
            self.collectives = self.wrapped.num_collectives
            return
        self.collectives = 0
        self.in_backward = 0 if mode in ("naive", "torch_ddp") else None
        self.opt.zero_grad()
        with record_function("forward"):
            loss = self.wrapped(x, y)
        self._backward_running = True
        with record_function("backward"):
            loss.backward()
        self._backward_running = False
        if mode == "naive":
            self.collectives = allreduce_gradients_naive(self.module, self.group, comm_log=self.log)
        elif mode == "overlapped":
            self.wrapped.finish_gradient_synchronization()
            self.collectives = self.wrapped.num_collectives
            self.in_backward = self.wrapped.launched_in_backward
        with record_function("optimizer.step"):
            self.opt.step()


def train_steps(
    modes: Sequence[str] = ("compute", "naive", "overlapped"),
    config: Any = None,
    batch_size: int = 16,
    *,
    steps: int = 5,
    warmup: int = 1,
    bucket_cap_mb: float = 25.0,
    lr: float = 0.1,
    seed: int = 0,
    check: bool = True,
    ddp_class: type | None = None,
    trace_modes: Sequence[str] = (),
    trace_dir: str | None = None,
    trace_steps: int = 2,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Time data-parallel training steps of a `labkit.models.GPT`, several ways; every rank calls it.

    `modes` (any of TRAIN_MODES), each on its own copy of the same initial model, with SGD:

    * "compute": forward, backward, optimizer step, no communication (compute alone);
    * "naive": the mistake, `allreduce_gradients_naive` after backward;
    * "overlapped": `ddp_class` (default `OverlappedDDP`) with `bucket_cap_mb`;
    * "torch_ddp": torch's DistributedDataParallel with the same `bucket_cap_mb`;
    * "comm_naive" / "comm_overlapped": the collectives of "naive" / "overlapped" (same sizes,
      same count, zero gradients) and nothing else (communication alone).

    The modes are interleaved step by step (all modes do step 1, then step 2, ...), so a
    slow spell of a noisy machine hits them all; a barrier precedes every timed step, and
    CUDA is synchronised before the clock is read. Rank r trains on
    `synthetic_batch(config, batch_size, seed=seed + r, step=s)`. With `check`, every
    rank also runs a single-process reference on the whole batch (all ranks' batches) and,
    after every step, records the largest absolute parameter difference of each training
    mode against it. Afterwards, the modes in `trace_modes` are profiled for `trace_steps`
    steps (after one warm-up) with `labkit.trace.capture`, one file per mode and rank.

    Returns a dict: "modes" maps each mode to {"ms": per-step times after warm-up,
    "cpu_ms": CPU time of the whole process (all threads) per step, "collectives" and
    "in_backward" (collectives launched before backward() returned) per step, "buckets"
    and "bucket_summary" (overlapped modes), "max_abs_diff" (after every step, warm-up
    included; None when not checked)}, plus "traces" {mode: path}, "param_tensors",
    "params", "grad_bytes", "rank", "world_size" and "device". Combine the ranks with
    `summarize_steps`.
    """
    from labkit.launch import device as _device
    from labkit.models import GPT, GPTConfig, synthetic_batch
    from labkit.trace import capture

    bad = [m for m in list(modes) + list(trace_modes) if m not in TRAIN_MODES]
    if bad:
        raise ValueError(f"train_steps: unknown mode(s) {bad}; choose from {list(TRAIN_MODES)}.")
    missing = [m for m in trace_modes if m not in modes]
    if missing:
        raise ValueError(f"train_steps: trace_modes {missing} must also be in modes={list(modes)}.")
    if steps < 1 or warmup < 0:
        raise ValueError(f"train_steps(steps={steps}, warmup={warmup}): need steps >= 1, warmup >= 0.")
    config = config if config is not None else GPTConfig()
    ddp_class = ddp_class if ddp_class is not None else OverlappedDDP
    dev = _device()
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return GPT(config).to(dev)

    def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return synthetic_batch(config, batch_size, seed=seed + r, step=step, device=dev)

    runs = {m: _Run(m, make_model, lr, bucket_cap_mb, ddp_class, process_group, dev) for m in modes}
    checked = [m for m in modes if m in ("naive", "overlapped", "torch_ddp")] if check else []
    ref = ref_opt = None
    if checked:
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    out = {m: {"ms": [], "cpu_ms": [], "collectives": [], "in_backward": [], "buckets": runs[m].buckets,
               "bucket_summary": runs[m].bucket_summary, "max_abs_diff": [] if m in checked else None}
           for m in modes}

    for s in range(warmup + steps):
        x, y = batch(s, rank)
        for m in modes:
            run = runs[m]
            dist.barrier(group=process_group)
            _sync(dev)
            t0, cpu0 = time.perf_counter(), time.process_time()
            run.step(x, y)
            _sync(dev)
            ms = (time.perf_counter() - t0) * 1e3
            cpu_ms = (time.process_time() - cpu0) * 1e3
            if s >= warmup:
                out[m]["ms"].append(ms)
                out[m]["cpu_ms"].append(cpu_ms)
                out[m]["collectives"].append(run.collectives)
                out[m]["in_backward"].append(run.in_backward)
        if ref is not None:
            xs, ys = zip(*(batch(s, r) for r in range(world)))
            ref_opt.zero_grad()
            ref(torch.cat(xs), torch.cat(ys)).backward()  # mean over the whole batch
            ref_opt.step()
            for m in checked:
                out[m]["max_abs_diff"].append(_max_abs_diff(runs[m].module, ref))

    traces = {}
    for m in trace_modes:
        run = runs[m]
        x, y = batch(warmup + steps, rank)
        run.log.clear()
        folder = Path(trace_dir) if trace_dir else Path(tempfile.gettempdir()) / "labkit_traces"
        dist.barrier(group=process_group)
        path = capture(lambda run=run, x=x, y=y: run.step(x, y), steps=trace_steps, warmup=1,
                       path=folder / f"{m}_rank{{rank}}.json", comm_log=run.log)
        traces[m] = str(path)
    dist.barrier(group=process_group)

    params = [p for p in runs[modes[0]].module.parameters() if p.requires_grad]
    return {
        "modes": out,
        "traces": traces,
        "param_tensors": len(params),
        "params": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "rank": rank,
        "world_size": world,
        "device": str(dev),
    }


def summarize_steps(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Combine `train_steps` results of all ranks: per mode, the median step time (ms).

    A data-parallel step is as slow as its slowest rank, so each step's time is the
    maximum over ranks; the median over steps is then robust to a noisy machine. Also
    gives the CPU time per step (median per rank, mean over ranks), the collectives per
    step, how many were launched during backward, the number of buckets and the worst
    parameter difference against the single-process reference.
    """
    if not results:
        raise ValueError("summarize_steps got no results; pass the list that labkit.launch returned.")
    summary = {}
    for m in results[0]["modes"]:
        per_rank = [r["modes"][m] for r in results]
        step_max = [max(ms) for ms in zip(*(pr["ms"] for pr in per_rank))]
        diffs = [d for pr in per_rank for d in (pr["max_abs_diff"] or [])]
        in_bwd = per_rank[0]["in_backward"][-1] if per_rank[0]["in_backward"] else None
        summary[m] = {
            "ms": statistics.median(step_max),
            "ms_steps": step_max,
            "cpu_ms": statistics.mean(statistics.median(pr["cpu_ms"]) for pr in per_rank),
            "collectives": per_rank[0]["collectives"][-1] if per_rank[0]["collectives"] else 0,
            "in_backward": in_bwd,
            "buckets": per_rank[0]["buckets"],
            "max_abs_diff": max(diffs) if diffs else None,
        }
    return summary
