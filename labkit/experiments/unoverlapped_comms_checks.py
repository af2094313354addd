"""Lab 03's exercise: the base class the learner subclasses, and the checks that drive the learner's
hooks in a shuffled order and name the mistake made (a bucket flushed again or out of order, gradients
averaged twice, nothing reduced).

A learner who subclasses `labkit.OverlappedDDP` itself would inherit the answer (`super().flush(...)` passes
every check). `OverlappedDDPExercise` raises `NotImplementedError` for exactly the methods the exercise asks
for; everything else is the reference's, which stays in `labkit.parallel.data.OverlappedDDP`."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.models import GPTConfig, seeded_model
from labkit.parallel.data import Bucket, OverlappedDDP

__all__ = ["HookDrill", "OverlappedDDPExercise", "check_overlapped_ddp", "drive_hooks_shuffled"]


class OverlappedDDPExercise(OverlappedDDP):
    """Lab 03's exercise: `OverlappedDDP` without its gradient hook and its bucket flush."""

    def on_grad_ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError(
            "on_grad_ready(param) is yours to write in your subclass: count param as ready in "
            "self.bucket_of[id(param)], then flush every complete bucket from self.next_bucket on, in order."
        )

    def flush(self, bucket: Bucket) -> None:
        raise NotImplementedError(
            "flush(bucket) is yours to write in your subclass: copy the gradients into bucket.buffer, start "
            "dist.all_reduce(..., async_op=True), keep the work in bucket.work, call "
            "self.after_launch(bucket, t0)."
        )


class _OutOfOrder(Exception):
    """A bucket was flushed out of index order (raised before its collective is issued)."""


@dataclass(frozen=True)
class HookDrill:
    """What `drive_hooks_shuffled` saw on one rank: the order buckets were flushed in, the bucket count, and
    the gradients' distinct values after `finish_gradient_synchronization()` (empty after an out-of-order
    flush)."""

    flushed: list[int]
    buckets: int
    values: list[float]
    rank: int


def drive_hooks_shuffled(ddp_class: type, bucket_cap_mb: float = 0.002, seed: int = 0) -> HookDrill:
    """On a rank: call a DDP class's gradient hook for every parameter in a shuffled order.

    Gradients are set by hand (rank + 1 everywhere), so the expected average is known; the
    order is the same on every rank (one seed), as a backward whose gradients come out of order
    would be. Returns the order buckets were flushed in, the bucket count and the gradients'
    distinct values after `finish_gradient_synchronization()`.
    """

    model = seeded_model(GPTConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8), seed)
    ddp = ddp_class(model, bucket_cap_mb=bucket_cap_mb)
    flushed: list[int] = []
    flush = ddp.flush

    def recorded_flush(bucket: Any) -> None:  # record; stop before a wrong flush issues its collective
        flushed.append(bucket.index)
        if flushed != list(range(len(flushed))):
            raise _OutOfOrder(flushed)
        flush(bucket)

    ddp.flush = recorded_flush
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    values: list[float] = []  # stays empty when a flush came out of order
    try:
        for p in random.Random(seed).sample(params, len(params)):
            ddp.on_grad_ready(p)
        ddp.finish_gradient_synchronization()
        values = sorted({round(v, 6) for p in params for v in p.grad.unique().tolist()})
    except _OutOfOrder:
        pass
    return HookDrill(flushed, len(ddp.buckets), values, dist.get_rank())


def check_overlapped_ddp(results: list[HookDrill], world_size: int) -> None:
    """Lab 03: buckets flushed once each, in index order, and gradients averaged exactly once."""
    expected = (world_size + 1) / 2  # the mean of 1 .. world_size
    for r in results:
        k, flushed = r.buckets, r.flushed
        again = [b for i, b in enumerate(flushed) if b in flushed[:i]]
        if again:
            raise AssertionError(
                f"rank {r.rank}: bucket {again[0]} was flushed again (order {flushed}): flush each bucket "
                "once, and advance self.next_bucket after each flush."
            )
        if flushed != list(range(k)):
            raise AssertionError(
                f"rank {r.rank} flushed buckets in the order {flushed}{'...' if len(flushed) < k else ''}, "
                f"not 0, 1, ..., {k - 1}, with the hooks called in a shuffled order. Flush buckets in index "
                "order, never as they fill up: only self.buckets[self.next_bucket], once it is complete, "
                "then the next index while buckets are complete."
            )
        if r.values == [expected]:
            continue
        if r.values == [expected / world_size]:
            raise AssertionError(
                f"the gradients came out as {expected / world_size:g} instead of the mean {expected:g}: they "
                "were divided by the world size twice. finish_gradient_synchronization() already divides "
                "the all-reduced sum by world_size; in flush copy the gradients as they are."
            )
        if r.values == [float(r.rank + 1)]:
            raise AssertionError(
                "the gradients are unchanged after finish_gradient_synchronization(): the buffer was not "
                "all-reduced, or did not receive the gradients. In flush copy each p.grad into bucket.buffer "
                "at its offset, then dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)."
            )
        raise AssertionError(
            f"rank {r.rank}: gradients {r.values[:4]} after synchronisation, expected {expected:g} "
            "everywhere; check that every parameter's gradient lands at its own offset (zip bucket.params, "
            "bucket.offsets)."
        )
