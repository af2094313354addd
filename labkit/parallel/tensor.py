"""Tensor parallelism for the lab GPT: Megatron-LM's split of each block over a process group.

Shoeybi et al. 2019 ("Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3) split each transformer block over t ranks with two conjugate operators:
**f** (`copy_to_tp`: identity forward, all-reduce of the gradient backward) and **g**
(`reduce_from_tp`: all-reduce forward, identity backward). The first matrix of the attention and
of the MLP (`attn.qkv`, `mlp.fc`) is split by output columns (`ColumnParallelLinear`, f on its
input), the second (`attn.proj`, `mlp.proj`) by input rows (`RowParallelLinear`, g on its output),
so the nonlinearity in between (attention per head, GELU per channel) runs on local data and each
block costs exactly two all-reduces forward and two backward. `tensor_parallel` converts a `GPT`
in place; `check_tp_size` says which sizes a config allows; `shard_state` is the one slicing rule
(the layers use it too), for comparing with a single process.

The embeddings, every LayerNorm and the head stay replicated on every TP rank here; they see the same
input, so their gradients are already equal on every rank and need no extra communication.
`vocab.py` splits the embedding, the head and the loss along the vocabulary (section 3's split of the output
embedding); `sequence.py` splits what lies outside f and g along the sequence (Korthikanti et al. 2022).
Every rank must start from the same full model (e.g. `labkit.models.seeded_model`). The process group is
always passed explicitly (None: the default group); nothing is global. Neighbours: `vocab.py`, `sequence.py`,
`data.py`, `pipeline.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.models import GPT, Block, GPTConfig, causal_attention, check_tp_size, swiglu

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPStats",
    "TensorParallelBlock",
    "copy_to_tp",
    "reduce_from_tp",
    "shard",
    "shard_state",
    "tensor_parallel",
]


@dataclass
class TPStats:
    """What the TP layers communicated: all-reduce calls and their bytes (numel x element size),
    forward and backward together. Pass one in; the layers add to it."""

    all_reduces: int = 0
    bytes: int = 0


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, stats: TPStats | None) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x  # nothing to sum, and nothing to count: tp=1 is the single-process model
    # A fresh contiguous buffer: all_reduce works in place, and autograd may still need `x`
    # (or hand us a gradient that another branch shares).
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        stats.all_reduces += 1
        stats.bytes += out.numel() * out.element_size()
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Each rank's column slice sent back only its share of dL/dx: the sum is the full one.
        return _all_reduce(grad, ctx.group, ctx.stats), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        return _all_reduce(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        # The sum's gradient with respect to each addend is the gradient itself.
        return grad, None, None


def copy_to_tp(
    x: torch.Tensor, group: dist.ProcessGroup | None, stats: TPStats | None = None
) -> torch.Tensor:
    """Megatron's f: `x` unchanged forward; its gradient all-reduced (summed) over `group` backward."""
    return _CopyToTP.apply(x, group, stats)


def reduce_from_tp(
    x: torch.Tensor, group: dist.ProcessGroup | None, stats: TPStats | None = None
) -> torch.Tensor:
    """Megatron's g: `x` all-reduced (summed) over `group` forward; the gradient unchanged backward."""
    return _ReduceFromTP.apply(x, group, stats)


def shard(
    full: torch.Tensor, rank: int, tp: int, dim: int = 0, sections: Sequence[int] | None = None
) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/tp of `full` along `dim`; with `sections`, of each section
    separately, concatenated (a fused qkv: every rank gets its own heads of q, k and v)."""
    parts = full.split(list(sections), dim=dim) if sections is not None else (full,)
    out = []
    for part in parts:
        if part.shape[dim] % tp:
            raise ValueError(
                f"tp={tp} does not divide a section of {part.shape[dim]} along dim {dim}: "
                f"use a tp that divides {part.shape[dim]} (see check_tp_size)"
            )
        n = part.shape[dim] // tp
        out.append(part.narrow(dim, rank * n, n))
    return torch.cat(out, dim=dim)  # a copy (even of one part): the full tensor is not kept alive


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a full `nn.Linear`; the output stays split (no gather).

    forward: `F.linear(copy_to_tp(x), weight, bias)` with this rank's rows of the weight and bias."""

    def __init__(
        self,
        linear: nn.Linear,
        group: dist.ProcessGroup | None = None,
        sections: Sequence[int] | None = None,
        stats: TPStats | None = None,
    ) -> None:
        super().__init__()
        self.group, self.stats = group, stats
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(shard(linear.weight.detach(), rank, tp, 0, sections))
        self.bias = (
            None if linear.bias is None else nn.Parameter(shard(linear.bias.detach(), rank, tp, 0, sections))
        )
        self.in_features, self.out_features = linear.in_features, self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group, self.stats), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of a full `nn.Linear`; takes the split input a column-parallel
    layer leaves. forward: `reduce_from_tp(F.linear(x_local, weight_local)) + bias`."""

    def __init__(
        self, linear: nn.Linear, group: dist.ProcessGroup | None = None, stats: TPStats | None = None
    ) -> None:
        super().__init__()
        self.group, self.stats = group, stats
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(shard(linear.weight.detach(), rank, tp, 1))
        # Replicated, and added once after the sum: adding it on every rank would count it t times.
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.in_features, self.out_features = self.weight.shape[1], linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group, self.stats)
        return y if self.bias is None else y + self.bias


def _qkv_sections(config: GPTConfig) -> list[int]:
    kv_dim = config.kv_heads * config.head_dim
    return [config.d_model, kv_dim, kv_dim]


# The one slicing rule: parameter name inside a Block -> (dim, sections of that dim, or None).
# Any other parameter (LayerNorms, attn.proj.bias, mlp.proj.bias, embeddings, head) is replicated.
def _block_rule(config: GPTConfig) -> dict[str, tuple[int, list[int] | None]]:
    qkv = _qkv_sections(config)
    fc = _fc_sections(config)
    return {
        "attn.qkv.weight": (0, qkv),
        "attn.qkv.bias": (0, qkv),
        "attn.proj.weight": (1, None),
        "mlp.fc.weight": (0, fc),
        "mlp.fc.bias": (0, fc),
        "mlp.proj.weight": (1, None),
    }


def _fc_sections(config: GPTConfig) -> list[int] | None:
    """A llama block's fused [gate | up]: each rank takes its own columns of both (None: one section)."""
    return [config.ffn_dim, config.ffn_dim] if config.block == "llama" else None


def shard_state(
    tensors: Mapping[str, torch.Tensor], config: GPTConfig, rank: int, tp: int, *, vocab: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's part of each of a full GPT's tensors by name (parameters or their gradients,
    names as in `named_parameters()`): what `tensor_parallel` keeps on TP rank `rank` of `tp`, and with
    `vocab` what `labkit.parallel.vocab.vocab_parallel` keeps too (the embedding's and head's rows)."""
    rule = _block_rule(config)
    out = {}
    for name, t in tensors.items():
        suffix = name.split(".", 2)[2] if name.startswith("blocks.") else None
        if suffix in rule:
            dim, sections = rule[suffix]
            out[name] = shard(t, rank, tp, dim, sections)
        elif vocab and name in ("tok_emb.weight", "lm_head.weight"):
            out[name] = shard(t, rank, tp, 0)
        else:
            out[name] = t
    return out


class _ParallelAttention(nn.Module):
    """This rank's n_heads/t query heads and kv_heads/t k/v heads."""

    def __init__(self, attn: nn.Module, config: GPTConfig, group, stats) -> None:
        super().__init__()
        tp = dist.get_world_size(group)
        self.n_heads, self.kv_heads, self.head_dim = (
            config.n_heads // tp,
            config.kv_heads // tp,
            config.head_dim,
        )
        self.qkv = ColumnParallelLinear(attn.qkv, group, _qkv_sections(config), stats)
        self.proj = RowParallelLinear(attn.proj, group, stats)
        self.rope = config.block == "llama"  # rotary positions act per head: the same on every rank's heads

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention of its slice of qkv (no communication)."""
        # Local query head j uses local k/v head j // group, as in the full model: both sets are contiguous
        # and t divides both counts, so each rank's groups are whole.
        return causal_attention(qkv, self.n_heads, self.kv_heads, self.head_dim, rope=self.rope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x)))


class _ParallelMLP(nn.Module):
    def __init__(self, mlp: nn.Module, config: GPTConfig, group, stats) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(mlp.fc, group, _fc_sections(config), stats)
        self.llama = config.block == "llama"
        self.proj = RowParallelLinear(mlp.proj, group, stats)

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """GELU, or SwiGLU of [gate | up]: elementwise over the hidden channels, so they run on this rank's
        split ones with no communication (each rank holds the same columns of gate and up)."""
        return swiglu(hidden) if self.llama else F.gelu(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activate(self.fc(x)))


class TensorParallelBlock(nn.Module):
    """A `Block` split over `group`: the same parameter names, attention and MLP sharded, LayerNorms
    replicated (the block's own modules). Two all-reduces forward (g after attn.proj and mlp.proj)
    and two backward (f before attn.qkv and mlp.fc)."""

    def __init__(
        self,
        block: Block,
        config: GPTConfig,
        group: dist.ProcessGroup | None = None,
        stats: TPStats | None = None,
    ) -> None:
        super().__init__()
        check_tp_size(config, dist.get_world_size(group))
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2
        self.attn = _ParallelAttention(block.attn, config, group, stats)
        self.mlp = _ParallelMLP(block.mlp, config, group, stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def tensor_parallel(model: GPT, group: dist.ProcessGroup | None = None, stats: TPStats | None = None) -> GPT:
    """Replace every block of `model` by its `TensorParallelBlock` over `group`, in place; returns `model`.

    The tensor-parallel size is `group`'s size and this rank's shard its rank in `group`. Every rank of
    `group` must hold the same weights before the call. Embeddings, ln_f and lm_head stay replicated."""
    if not isinstance(model, GPT):
        raise ValueError(f"tensor_parallel(model) needs a labkit.models.GPT, got {type(model).__name__}")
    check_tp_size(model.config, dist.get_world_size(group))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = TensorParallelBlock(block, model.config, group, stats)
    return model
