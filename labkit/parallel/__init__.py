"""Parallel training building blocks over explicit process groups, one parallelism per module.

* `data.py`: data parallelism, the naive per-tensor all-reduce, `OverlappedDDP` (bucketed
  all-reduce from gradient hooks) and gradient accumulation with `no_sync`;
* `pipeline.py`: pipeline parallelism, a GPT cut into stages of consecutive layers and run by
  `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B).

Tensor parallelism (lab 01) will sit next to them.
"""

from labkit.parallel.data import (
    OverlappedDDP,
    accumulate_with_no_sync,
    accumulate_without_no_sync,
    allreduce_gradients_naive,
)
from labkit.parallel.pipeline import GPTStage, even_split, layer_names, make_schedule, pipeline_stages

__all__ = [
    "GPTStage",
    "OverlappedDDP",
    "accumulate_with_no_sync",
    "accumulate_without_no_sync",
    "allreduce_gradients_naive",
    "even_split",
    "layer_names",
    "make_schedule",
    "pipeline_stages",
]
