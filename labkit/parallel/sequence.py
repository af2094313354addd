"""Sequence parallelism: the parts of a tensor-parallel block that Megatron's split leaves whole, split along
the sequence instead (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2).

`tensor.py` splits attention and the MLP over t ranks, but every rank still holds the whole residual stream,
runs both norms on it, and keeps their inputs for backward: Korthikanti et al.'s 10 of 34 bytes per token and
channel that do not shrink with t. Here each rank keeps 1/t of the sequence outside attention and the MLP:

    x (s/t)  ->  ln_1  ->  all-gather (g)  ->  qkv, attention, proj  ->  reduce-scatter (ḡ)  ->  + x (s/t)

and the same around the MLP. Forward, an all-gather replaces f (identity) and a reduce-scatter replaces g
(all-reduce); backward, the two swap. An all-reduce is a reduce-scatter then an all-gather, so the bytes
on the wire are the same as tensor parallelism alone; the activations outside the split layers shrink t
times. The first block takes its rank's share of the sequence (backward: the gradient gathered whole), the
last gathers the whole sequence back for the final norm and the head (backward: its share again: the head's
input gradient is already whole on every rank). The norms' weights and the row-parallel layers' biases now see
1/t of the tokens each, so their gradients are summed over the group when backward reaches them (a hook on
each).

`sequence_parallel(model, group, stats)` converts a GPT whose blocks `tensor_parallel` has split, in place.
Not combined here with pipeline stages. The process group is passed explicitly. Neighbours: `tensor.py`,
`vocab.py`; `labkit.memory.estimate(sequence_parallel=True)` counts its activations.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.models import GPT
from labkit.parallel.tensor import TensorParallelBlock, TPStats

__all__ = ["SequenceParallelBlock", "gather_sequence", "reduce_scatter_sequence", "sequence_parallel"]


def _count(stats: TPStats | None, t: torch.Tensor) -> None:
    if stats is not None:
        stats.all_reduces += 1  # one collective (an all-gather or a reduce-scatter here)
        stats.bytes += t.numel() * t.element_size()


def _gather(x: torch.Tensor, group, stats) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h), the ranks' shares in rank order."""
    tp = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x, group=group)  # stacks along dim 0: (tp, b, s/t, h)
    _count(stats, out)
    return out.view(tp, *x.shape).transpose(0, 1).reshape(x.shape[0], tp * x.shape[1], *x.shape[2:])


def _reduce_scatter(x: torch.Tensor, group, stats) -> torch.Tensor:
    """(b, s, h) partial sums on each rank -> this rank's (b, s/t, h) of their sum."""
    tp = dist.get_world_size(group)
    b, s = x.shape[0], x.shape[1]
    parts = x.reshape(b, tp, s // tp, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty((b, s // tp, *x.shape[2:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, parts.view(tp * b, s // tp, *x.shape[2:]), group=group)
    _count(stats, parts)
    return out


def _share(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's s/t of the sequence."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    if x.shape[1] % tp:
        raise ValueError(
            f"sequence parallelism over {tp} ranks needs a sequence length divisible by {tp}, got "
            f"{x.shape[1]}: use {x.shape[1] - x.shape[1] % tp or tp} tokens, or tensor parallelism alone"
        )
    return x.chunk(tp, dim=1)[rank].contiguous()


class _Scatter(torch.autograd.Function):  # whole -> share; backward: gather
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _share(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.stats), None, None


class _GatherWhole(torch.autograd.Function):  # share -> whole; backward: share (the gradient is whole)
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group = group
        return _gather(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _share(grad, ctx.group), None, None


class _Gather(torch.autograd.Function):  # before a column-parallel layer; backward: reduce-scatter
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _gather(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.stats), None, None


class _ReduceScatter(torch.autograd.Function):  # after a row-parallel layer; backward: gather
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _reduce_scatter(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.stats), None, None


def gather_sequence(x: torch.Tensor, group=None, stats: TPStats | None = None) -> torch.Tensor:
    """Korthikanti's g: the whole sequence from every rank's share forward; backward, the gradient
    reduce-scattered (each rank's layers after it saw the whole sequence and gave a partial sum)."""
    return _Gather.apply(x, group, stats)


def reduce_scatter_sequence(x: torch.Tensor, group=None, stats: TPStats | None = None) -> torch.Tensor:
    """Korthikanti's ḡ: the partial sums of a row-parallel layer summed, and this rank's share of the
    sequence kept, forward; backward, the gradient gathered whole."""
    return _ReduceScatter.apply(x, group, stats)


class SequenceParallelBlock(nn.Module):
    """A `TensorParallelBlock` whose residual stream and norms hold this rank's share of the sequence: the
    same modules and parameter names; all-gather before qkv and fc, reduce-scatter after both proj."""

    def __init__(
        self,
        block: TensorParallelBlock,
        group: dist.ProcessGroup | None = None,
        stats: TPStats | None = None,
        *,
        first: bool = False,
        last: bool = False,
    ) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.group, self.stats, self.first, self.last = group, stats, first, last
        # What now sees a share of the tokens: its gradient is a partial sum, completed over the group.
        for p in (*self.ln_1.parameters(), *self.ln_2.parameters(), self.attn.proj.bias, self.mlp.proj.bias):
            if p is not None:
                p.register_hook(partial(_sum_over_group, group=group, stats=stats))

    def _row(self, layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        out = reduce_scatter_sequence(F.linear(y, layer.weight), self.group, self.stats)
        return out if layer.bias is None else out + layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = _Scatter.apply(x, self.group, self.stats)
        attn, mlp = self.attn, self.mlp
        h = gather_sequence(self.ln_1(x), self.group, self.stats)
        x = x + self._row(attn.proj, attn.attend(F.linear(h, attn.qkv.weight, attn.qkv.bias)))
        h = F.linear(gather_sequence(self.ln_2(x), self.group, self.stats), mlp.fc.weight, mlp.fc.bias)
        x = x + self._row(mlp.proj, mlp.activate(h))
        return _GatherWhole.apply(x, self.group, self.stats) if self.last else x


def _sum_over_group(grad: torch.Tensor, group, stats) -> torch.Tensor:
    out = grad.contiguous().clone()
    dist.all_reduce(out, group=group)
    _count(stats, out)
    return out


def sequence_parallel(
    model: GPT, group: dist.ProcessGroup | None = None, stats: TPStats | None = None
) -> GPT:
    """Split the sequence outside attention and the MLP in every block of `model` over `group` (the same
    group `tensor_parallel` split the blocks over), in place; returns `model`. The sequence length must
    divide by the group's size."""
    if not isinstance(model, GPT) or not all(isinstance(b, TensorParallelBlock) for b in model.blocks):
        raise ValueError(
            "sequence_parallel(model) needs a labkit.models.GPT whose blocks tensor_parallel split: call "
            "tensor_parallel(model, group) first"
        )
    n = len(model.blocks)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = SequenceParallelBlock(block, group, stats, first=i == 0, last=i == n - 1)
    return model
