"""The one data split, and the single-process reference every data-parallel step is checked against.

Every data-parallel experiment in the course follows the same contract, so that its numerics can be
checked against one process:

* the model is `labkit.models.seeded_model(config, seed)`, so every rank and the reference start from the
  same weights;
* step s trains on the global batch `synthetic_batch(config, global_batch, seed=seed, step=s)`; rank r takes
  its rows [r·B/n, (r+1)·B/n) (`rank_rows`), cut into micro-batches in order;
* the reference runs the whole global batch in one process (`reference_backward`, `reference_gradients`):
  the mean loss over all rows, which data parallelism with averaged gradients must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from labkit import validate
from labkit.models import GPTConfig, seeded_model, synthetic_batch

__all__ = ["Reference", "max_abs_diff", "rank_rows", "reference_backward", "reference_gradients"]


def rank_rows(
    config: GPTConfig,
    global_batch: int,
    rank: int,
    world_size: int,
    *,
    step: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows (x, y) of global batch number `step` (see the module docstring)."""
    validate.positive_int("global_batch", global_batch)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in 0..{world_size - 1} (world_size={world_size})")
    if global_batch % world_size:
        raise ValueError(
            f"global_batch({global_batch}) must divide over world_size({world_size}); "
            f"e.g. global_batch={global_batch // world_size * world_size or world_size}"
        )
    x, y = synthetic_batch(config, global_batch, seed=seed, step=step)
    per_rank = global_batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    # clone: a slice would keep the whole global batch alive on every rank
    return x[rows].clone().to(device), y[rows].clone().to(device)


def reference_backward(
    model: nn.Module, config: GPTConfig, global_batch: int, *, step: int = 0, seed: int = 0
) -> torch.Tensor:
    """Zero `model`'s gradients and backpropagate the mean loss of the whole global batch `step`.

    This is the single-process run a data-parallel step must match. Returns the loss.
    """
    for p in model.parameters():
        p.grad = None
    x, y = synthetic_batch(config, global_batch, seed=seed, step=step)
    device = next(model.parameters()).device
    loss = model(x.to(device), y.to(device))
    loss.backward()
    return loss.detach()


@dataclass(frozen=True)
class Reference:
    """One process's loss and gradients (by parameter name) on the whole first global batch."""

    loss: float
    grads: dict[str, torch.Tensor]

    def flat(self) -> torch.Tensor:
        """The gradients flattened in parameter order, as one tensor."""
        return torch.cat([g.flatten() for g in self.grads.values()])


def reference_gradients(config: GPTConfig, global_batch: int, *, seed: int = 0) -> Reference:
    """The big-batch loss and gradients a data-parallel first step must reproduce, in one process, on the
    CPU."""
    validate.positive_int("global_batch", global_batch)
    model = seeded_model(config, seed)
    loss = reference_backward(model, config, global_batch, step=0, seed=seed)
    return Reference(loss.item(), {n: p.grad.detach() for n, p in model.named_parameters()})


def max_abs_diff(model: nn.Module, reference: nn.Module) -> float:
    """The largest absolute difference between two models' parameters."""
    with torch.no_grad():
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
