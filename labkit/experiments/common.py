"""What every lab driver shares: a seeded model, one way to split the data, a single-process
reference, and a DDP comm hook that counts its all-reduces.

Every data-parallel experiment in the course follows the same contract, so that its
numerics can be checked against one process:

* the model is `GPT(config)` made right after `torch.manual_seed(seed)` (`seeded_model`),
  so every rank and the reference start from the same weights;
* step s trains on the global batch `synthetic_batch(config, global_batch, seed=seed,
  step=s)`; rank r takes its rows [r·B/n, (r+1)·B/n) (`rank_rows`);
* the reference runs the whole global batch in one process (`reference_backward`): the mean
  loss over all rows, which data parallelism with averaged gradients must reproduce.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from labkit import emulate, validate
from labkit.models import GPT, GPTConfig, synthetic_batch
from labkit.trace.commlog import CommLog

__all__ = ["CountingAllReduce", "max_abs_diff", "rank_rows", "reference_backward", "seeded_model"]


def seeded_model(
    config: GPTConfig, seed: int = 0, device: torch.device | str = "cpu", *, checkpointing: bool = False
) -> GPT:
    """`GPT(config)` with the weights `torch.manual_seed(seed)` gives, on `device`."""
    torch.manual_seed(seed)
    return GPT(config, checkpointing=checkpointing).to(device)


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


def max_abs_diff(model: nn.Module, reference: nn.Module) -> float:
    """The largest absolute difference between two models' parameters."""
    with torch.no_grad():
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


class CountingAllReduce:
    """A DDP comm hook that does DDP's default (average, then all-reduce the bucket) and counts it.

        counter = CountingAllReduce(group, log=comm_log)
        ddp.register_comm_hook(counter, CountingAllReduce.hook)

    `calls` lists (bucket index, bytes) of every all-reduce; `in_backward` counts those launched
    while `backward_running` was set; with a `CommLog` each is logged from issue to completion.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, log: CommLog | None = None) -> None:
        self.process_group = process_group
        self.log = log
        self.calls: list[tuple[int, int]] = []
        self.in_backward = 0
        self.backward_running = False

    @staticmethod
    def hook(state, bucket):  # unannotated: DDP rejects annotations other than its own
        buf = bucket.buffer().div_(dist.get_world_size(state.process_group))
        nbytes = buf.numel() * buf.element_size()
        state.calls.append((bucket.index(), nbytes))
        state.in_backward += state.backward_running
        t0 = time.perf_counter_ns()
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)
        emulate.wait_at_end_of_backward(work)  # DDP waits for the hook's future in C++ (virtual clock)
        logged = None
        if state.log is not None:
            logged = state.log.track(work, f"all_reduce ddp_bucket{bucket.index()}", nbytes, start_ns=t0)
        fut = work.get_future() if logged is None else logged

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            f.wait()  # re-raise a failed collective's error
            return buf

        return fut.then(reduced)

    def clear(self) -> None:
        self.calls.clear()
        self.in_backward = 0
