"""`OverlappedDDP` as the course runs it: the teaching class (`labkit.parallel.data`) and what the course
needs around it, kept out of the part a learner reads.

* Checks where a hand-written `flush` goes wrong (lab 03's exercise), raised where it happens with the fix:
  the all-reduce's work missing, a bucket flushed twice or out of index order; and a gradient ready twice
  in one step (a backward without `finish_gradient_synchronization`).
* Hooks that hold the wrapper weakly and go when it goes, as torch DDP's reducer removes its hooks when it is
  destroyed (`reducer.cpp`: `~Reducer` calls `remove_autograd_hooks`). A bound method closes the cycle
  parameter -> hook -> wrapper -> buckets -> parameter, which only the garbage collector frees, and it does
  not where the parameters are FakeTensors (a simulated machine): each dropped training job there would keep
  its parameters and Adam's states allocated.
* `remove_hooks`, and `bucket_summary` for the lab's tables.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from labkit.parallel.data import Bucket, OverlappedDDP

__all__ = ["CourseOverlappedDDP", "bucket_summary"]


class CourseOverlappedDDP(OverlappedDDP):
    """`OverlappedDDP` with the course's checks and hooks that let a dropped wrapper go (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ready: set[int] = set()  # ids of the parameters whose gradient is ready this step

    def register_hooks(self) -> list[Any]:
        owner = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            ddp = owner()
            if ddp is not None:
                ddp.on_grad_ready(param)

        handles = [p.register_post_accumulate_grad_hook(hook) for b in self.buckets for p in b.params]
        weakref.finalize(self, _remove_hooks, handles)
        return handles

    def on_grad_ready(self, param: torch.Tensor) -> None:
        if self.require_sync:
            if id(param) in self._ready:
                raise RuntimeError(
                    "a parameter's gradient became ready twice before finish_gradient_synchronization(); "
                    "call it after every backward, wrap the accumulation backwards in model.no_sync(), or "
                    "call remove_hooks() before training the wrapped module without OverlappedDDP."
                )
            self._ready.add(id(param))
        super().on_grad_ready(param)

    def after_launch(self, bucket: Bucket, start_ns: int) -> None:
        """Check what a `flush` written by hand gets wrong, here where it happens rather than deep inside the
        trace or the next step, then count and log the collective."""
        if not hasattr(bucket.work, "wait"):
            raise TypeError(
                f"bucket.work is {bucket.work!r} after flushing bucket {bucket.index}: start the all-reduce "
                "with async_op=True and keep what it returns in bucket.work (a synchronous dist.all_reduce "
                "returns None and waits, so nothing overlaps)"
            )
        if bucket.index < self._launched:
            raise RuntimeError(
                f"bucket {bucket.index} was flushed again in this step: flush each bucket once, and advance "
                "self.next_bucket after each flush"
            )
        if bucket.index != self._launched:
            raise RuntimeError(
                f"bucket {bucket.index} was flushed before bucket {self._launched}: launch buckets strictly "
                "in index order (from self.buckets[self.next_bucket] on, while each is complete), never in "
                "the order they fill up; a different order on another rank would pair different buckets"
            )
        super().after_launch(bucket, start_ns)

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        self._ready.clear()

    def remove_hooks(self) -> nn.Module:
        """Remove the gradient hooks from the wrapped module's parameters and return it.

        The hooks live on the parameters, so the bare `.module` still triggers them; call this before
        training it without the wrapper (for example with the naive all-reduce).
        """
        _remove_hooks(self._hooks)
        self._hooks = []
        return self.module


def bucket_summary(buckets: list[Bucket]) -> list[dict[str, Any]]:
    """One row per bucket: index, number of parameters, bytes and parameter names."""
    return [
        {"bucket": b.index, "params": len(b.params), "bytes": b.nbytes, "names": list(b.names)}
        for b in buckets
    ]


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
