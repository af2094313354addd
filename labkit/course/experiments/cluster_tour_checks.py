"""Lab 00's exercise check: its hint names the mistake made (an answer that is None, a value off by
the world size, nothing reduced)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_sum_over_ranks"]


def check_sum_over_ranks(results: list[Any], world_size: int) -> float:
    """Lab 00: every rank returned a tensor holding 1 + 2 + ... + n everywhere; returns that sum."""
    expected = world_size * (world_size + 1) / 2
    for rank, t in enumerate(results):
        if t is None:
            raise AssertionError(
                f"rank {rank} returned None: dist.all_reduce(t) changes t in place and returns None (or a "
                "work object with async_op=True). Call it without assigning its result "
                "(dist.all_reduce(t)), then return t."
            )
        if not isinstance(t, torch.Tensor):
            raise AssertionError(
                f"rank {rank} returned {type(t).__name__} {t!r}: return the tensor t itself."
            )
        if torch.all(t == expected):
            continue
        if torch.allclose(t, torch.full_like(t, expected / world_size)):
            raise AssertionError(
                f"rank {rank} holds {expected / world_size:g} = the sum divided by world_size: the exercise "
                "asks for the SUM over ranks (dist.all_reduce's default op); do not divide it."
            )
        if torch.all(t == rank + 1):
            raise AssertionError(
                f"rank {rank} still holds its own value {rank + 1}: nothing was reduced. Call "
                "dist.all_reduce(t) before returning t."
            )
        raise AssertionError(
            f"rank {rank} holds {t.tolist()}, expected {expected:g} everywhere "
            f"(1 + ... + {world_size}); use dist.all_reduce(t) with the default op, SUM."
        )
    return expected
