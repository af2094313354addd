"""Exercise bases: the classes a lab's exercise subclasses, with the learner's methods left out.

A learner who subclasses `labkit.OverlappedDDP` itself would inherit the answer (`super()._flush(...)`
passes every check). The bases here raise `NotImplementedError` for exactly the methods the
exercise asks for; everything else is the reference's. The complete reference stays in
`labkit.parallel.data.OverlappedDDP`, which the rest of the course uses.
"""

from __future__ import annotations

from typing import Any

from labkit.parallel.data import OverlappedDDP

__all__ = ["OverlappedDDPExercise"]


class OverlappedDDPExercise(OverlappedDDP):
    """Lab 03's exercise: `OverlappedDDP` without its gradient hook and its bucket flush."""

    def _on_grad_ready(self, param: Any) -> None:
        raise NotImplementedError(
            "_on_grad_ready(param) is yours to write in your subclass: count param as ready in "
            "self._bucket_of[id(param)], then flush every complete bucket from self._next_bucket on, in order."
        )

    def _flush(self, bucket: Any) -> None:
        raise NotImplementedError(
            "_flush(bucket) is yours to write in your subclass: copy the gradients into bucket.buffer, start "
            "dist.all_reduce(..., async_op=True), keep the work in bucket.work, call self._after_launch(bucket, t0)."
        )
