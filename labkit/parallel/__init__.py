"""Parallel training building blocks over explicit process groups, one parallelism per module.

* `data.py`: data parallelism, the naive per-tensor all-reduce, `OverlappedDDP` (bucketed
  all-reduce from gradient hooks) and gradient accumulation with `no_sync`.

Tensor and pipeline parallelism (labs 01 and 04) will sit next to it.
"""

from labkit.parallel.data import (
    OverlappedDDP,
    accumulate_with_no_sync,
    accumulate_without_no_sync,
    allreduce_gradients_naive,
)

__all__ = ["OverlappedDDP", "accumulate_with_no_sync", "accumulate_without_no_sync", "allreduce_gradients_naive"]
