"""Vocabulary parallelism: the lab GPT's embedding, LM head and loss split over a tensor-parallel group.

`tensor.py` splits the blocks; the embedding and the LM head stay whole there, and at a 50-130K vocabulary
they are a large share of a small model's weights and of every model's last matmul. Shoeybi et al. 2019
(Megatron-LM, section 3) split both along the vocabulary: rank r of t holds rows [r V/t, (r+1) V/t) of each.

* **Embedding** (`VocabParallelEmbedding`): each rank looks up the tokens whose rows it holds and writes
  zeros for the others; the all-reduce (Megatron's g) sums the one non-zero row per token into the whole
  embedding on every rank.
* **Head**: a `ColumnParallelLinear` (f before it: the gradient of its input is all-reduced in backward). Its
  output is this rank's slice of the logits, never gathered: at 128K vocabulary the whole logits of one
  micro-batch would be gigabytes.
* **Loss** (`VocabParallelCrossEntropy`): the cross entropy of logits split along the vocabulary, from
  three all-reduces of one number per token: the maximum (for a stable softmax), the sum of the
  exponentials, and the target's logit (held by one rank). Backward is local: softmax minus the target's
  one-hot, on this rank's slice (Megatron-LM's `_VocabParallelCrossEntropy`).

`vocab_parallel` converts a GPT in place (after or before `tensor_parallel`); tied embeddings stay tied (one
shard serves both). With it, `GPT.forward(idx)` returns this rank's slice of the logits, and `forward(idx,
targets)` the whole loss. `shard_state(..., vocab=True)` is the matching slicing rule. The process group is
passed explicitly. Neighbours: `tensor.py` (f, g, the column-parallel layer, the blocks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.models import GPT
from labkit.parallel.tensor import ColumnParallelLinear, TPStats, reduce_from_tp, shard

__all__ = ["VocabParallelCrossEntropy", "VocabParallelEmbedding", "check_vocab_size", "vocab_parallel"]


def check_vocab_size(vocab_size: int, tp: int) -> None:
    """Refuse a tensor-parallel size that does not split the vocabulary evenly."""
    if vocab_size % tp:
        fitting = vocab_size + (-vocab_size) % tp
        raise ValueError(
            f"vocabulary parallelism over tp={tp} needs a vocab_size divisible by {tp}, got {vocab_size}: "
            f"pad the vocabulary to {fitting} (Megatron-LM pads to a multiple of 128 x tp), or keep the "
            "embedding and head whole"
        )


def _rows(vocab_size: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's vocabulary rows [start, stop)."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    check_vocab_size(vocab_size, tp)
    n = vocab_size // tp
    return rank * n, (rank + 1) * n


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group, stats: TPStats | None) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
        if stats is not None:
            stats.all_reduces += 1
            stats.bytes += x.numel() * x.element_size()
    return x


class VocabParallelEmbedding(nn.Module):
    """This rank's vocabulary rows of a full `nn.Embedding`; forward looks up the tokens it holds (zeros for
    the others) and sums over the group (g), so every rank gets the whole embedding."""

    def __init__(
        self, embedding: nn.Embedding, group: dist.ProcessGroup | None = None, stats: TPStats | None = None
    ) -> None:
        super().__init__()
        self.group, self.stats = group, stats
        self.start, self.stop = _rows(embedding.num_embeddings, group)
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(shard(embedding.weight.detach(), rank, tp, 0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        elsewhere = (idx < self.start) | (idx >= self.stop)
        local = (idx - self.start).masked_fill(elsewhere, 0)
        rows = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.group, self.stats)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, stop, group, stats):
        # A stable softmax over the whole vocabulary: subtract the global maximum of each token's logits.
        # (An in-place subtract below would also be Megatron's; a copy keeps the caller's logits intact.)
        top = _all_reduce(logits.detach().amax(dim=-1), dist.ReduceOp.MAX, group, stats)
        shifted = logits - top.unsqueeze(-1)
        elsewhere = (targets < start) | (targets >= stop)
        local = (targets - start).masked_fill(elsewhere, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
        picked = _all_reduce(picked, dist.ReduceOp.SUM, group, stats)  # the target's logit, from its rank
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group, stats)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, elsewhere)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        # d(mean loss)/d(logit) = (softmax - one-hot of the target) / tokens: on this rank's slice only.
        softmax, local, elsewhere = ctx.saved_tensors
        one_hot = (~elsewhere).to(softmax.dtype)
        grad_logits = softmax.scatter_add(-1, local.unsqueeze(-1), -one_hot.unsqueeze(-1))
        return grad_logits * (grad / local.numel()), None, None, None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """The mean cross entropy of logits split along the vocabulary over `group` (rank r holds columns
    [start, stop)), targets whole on every rank; the same loss on every rank."""

    def __init__(
        self, vocab_size: int, group: dist.ProcessGroup | None = None, stats: TPStats | None = None
    ) -> None:
        super().__init__()
        self.group, self.stats = group, stats
        self.start, self.stop = _rows(vocab_size, group)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCrossEntropy.apply(
            logits, targets, self.start, self.stop, self.group, self.stats
        )


def vocab_parallel(model: GPT, group: dist.ProcessGroup | None = None, stats: TPStats | None = None) -> GPT:
    """Split `model`'s token embedding, LM head and loss over `group` along the vocabulary, in place; returns
    `model`. Every rank of `group` must hold the same weights before the call."""
    if not isinstance(model, GPT):
        raise ValueError(f"vocab_parallel(model) needs a labkit.models.GPT, got {type(model).__name__}")
    check_vocab_size(model.config.vocab_size, dist.get_world_size(group))
    tied = model.lm_head.weight is model.tok_emb.weight
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, group, stats)
    model.lm_head = ColumnParallelLinear(model.lm_head, group, None, stats)
    if tied:
        model.lm_head.weight = model.tok_emb.weight
    model.criterion = VocabParallelCrossEntropy(model.config.vocab_size, group, stats)
    return model
