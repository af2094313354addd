"""Batch arithmetic: a global batch as micro-batches x accumulation steps x data-parallel ranks.

``accumulation_steps(global_batch, micro_batch, world_size)`` is how many micro-steps each
rank runs per optimizer step; ``choose_micro_batch`` picks the largest micro-batch that
fits memory and still divides the batch evenly. Both raise, with the values and a fix,
when the sizes do not divide: the optimizer would otherwise see another batch than asked.
Lab 02 (``labkit.course.experiments.oom_batch``) uses them with ``labkit.find_max_batch``.
"""

from __future__ import annotations

from labkit import validate

__all__ = ["accumulation_steps", "choose_micro_batch"]


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that micro_batch x steps x world_size == global_batch.

    Raises ValueError, with the values and a fix, when the sizes are not positive or the
    global batch does not divide into micro-batches over the ranks (the optimizer would then
    see a different batch than the one asked for).
    """
    for name, value in (
        ("global_batch", global_batch),
        ("micro_batch", micro_batch),
        ("world_size", world_size),
    ):
        validate.positive_int(name, value)
    per_step = micro_batch * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    if global_batch % world_size == 0:
        per_rank = global_batch // world_size
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        fix = (
            f"use a micro_batch that divides global_batch / world_size = {per_rank}: "
            f"{', '.join(map(str, divisors))}"
        )
    else:
        lower = global_batch // per_step * per_step
        fix = (
            f"use global_batch={lower or per_step} or {lower + per_step} "
            f"(a multiple of {per_step}), or another micro_batch"
        )
    if per_step > global_batch:
        problem = (
            f"micro_batch({micro_batch}) x world_size({world_size}) = {per_step} "
            f"> global_batch({global_batch})"
        )
    else:
        problem = (
            f"global_batch({global_batch}) is not divisible by micro_batch({micro_batch}) "
            f"x world_size({world_size}) = {per_step}"
        )
    raise ValueError(f"{problem}; every rank must run the same whole number of micro-steps: {fix}")


def choose_micro_batch(global_batch: int, world_size: int, max_fit: int) -> int:
    """Largest micro-batch <= ``max_fit`` that divides this rank's share of ``global_batch``.

    ``max_fit`` is the largest micro-batch that fits (e.g. ``max_micro_batch(...).batch``).
    Raises ValueError when not even one sample fits or the batch cannot be shared evenly.
    """
    validate.positive_int("global_batch", global_batch)
    validate.positive_int("world_size", world_size)
    if isinstance(max_fit, bool) or not isinstance(max_fit, int) or max_fit < 1:
        raise ValueError(
            f"max_fit={max_fit!r}: not even a micro-batch of 1 fits in memory; accumulation "
            f"cannot help. Use bf16 autocast, activation checkpointing, a shorter sequence, "
            f"or shard the model states (ZeRO / FSDP)"
        )
    if global_batch % world_size != 0:
        accumulation_steps(global_batch, 1, world_size)  # raises with the values and the fix
    per_rank = global_batch // world_size
    return max(d for d in range(1, min(per_rank, max_fit) + 1) if per_rank % d == 0)
