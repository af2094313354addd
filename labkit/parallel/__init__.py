"""Parallel training building blocks over explicit process groups, one parallelism per module.

* `data.py`: data parallelism, the naive per-tensor all-reduce, `OverlappedDDP` (bucketed
  all-reduce from gradient hooks) and gradient accumulation with `no_sync`;
* `pipeline.py`: pipeline parallelism, a GPT cut into stages of consecutive layers and run by
  `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B);
* `fsdp.py`: fully sharded data parallelism (ZeRO-3) with torch's FSDP2, one `fully_shard` per block
  (import it from its module: torch.distributed.fsdp takes 0.8 s to import, which ranks that do not shard
  should not pay);
* `tensor.py`: tensor parallelism in the Megatron style (f and g, column- and row-parallel layers);
* `vocab.py`: the embedding, LM head and loss split along the vocabulary over the tp group;
* `sequence.py`: sequence parallelism, the norms and residual stream split along the sequence over it;
* `groups.py`: how they combine: each rank's dp, tp and pp groups under a `labkit.layout.Layout`.
"""

from labkit.parallel.data import (
    OverlappedDDP,
    accumulate_with_no_sync,
    accumulate_without_no_sync,
    allreduce_gradients_naive,
)
from labkit.parallel.groups import RankGroups, make_groups
from labkit.parallel.pipeline import GPTStage, even_split, layer_names, make_schedule, pipeline_stages
from labkit.parallel.tensor import TensorParallelBlock, TPStats, tensor_parallel

__all__ = [
    "GPTStage",
    "OverlappedDDP",
    "RankGroups",
    "TPStats",
    "TensorParallelBlock",
    "accumulate_with_no_sync",
    "accumulate_without_no_sync",
    "allreduce_gradients_naive",
    "even_split",

    "layer_names",
    "make_groups",
    "make_schedule",
    "pipeline_stages",
    "tensor_parallel",
]
