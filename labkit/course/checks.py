"""Exercise checks: each names the mistake a learner actually made, not one general hint.

A check runs after an exercise cell; on a wrong answer it raises `AssertionError` whose message
says what was found, what it means and what to change. Checks that need ranks launch them with a
deadline, so a livelock ends in seconds. The reference answers are in `labkit.parallel` and the
solution notebooks; `tests/test_exercise_mistakes.py` runs the plausible wrong answers through them.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["check_accumulation", "check_overlapped_ddp", "check_sum_over_ranks", "drive_hooks_shuffled"]


def check_sum_over_ranks(results: list[Any], world_size: int) -> float:
    """Lab 00: every rank returned a tensor holding 1 + 2 + ... + n everywhere; returns that sum."""
    expected = world_size * (world_size + 1) / 2
    for rank, t in enumerate(results):
        if t is None:
            raise AssertionError(
                f"rank {rank} returned None: dist.all_reduce(t) changes t in place and returns None (or a work "
                "object with async_op=True). Call it without assigning its result (dist.all_reduce(t)), then "
                "return t.")
        if not isinstance(t, torch.Tensor):
            raise AssertionError(f"rank {rank} returned {type(t).__name__} {t!r}: return the tensor t itself.")
        if torch.all(t == expected):
            continue
        if torch.allclose(t, torch.full_like(t, expected / world_size)):
            raise AssertionError(
                f"rank {rank} holds {expected / world_size:g} = the sum divided by world_size: the exercise asks "
                "for the SUM over ranks (dist.all_reduce's default op); do not divide it.")
        if torch.all(t == rank + 1):
            raise AssertionError(
                f"rank {rank} still holds its own value {rank + 1}: nothing was reduced. Call dist.all_reduce(t) "
                "before returning t.")
        raise AssertionError(f"rank {rank} holds {t.tolist()}, expected {expected:g} everywhere "
                             f"(1 + ... + {world_size}); use dist.all_reduce(t) with the default op, SUM.")
    return expected


class _OutOfOrder(Exception):
    """A bucket was flushed out of index order (raised before its collective is issued)."""


def drive_hooks_shuffled(ddp_class: type, bucket_cap_mb: float = 0.002, seed: int = 0) -> dict[str, Any]:
    """On a rank: call a DDP class's gradient hook for every parameter in a shuffled order.

    Gradients are set by hand (rank + 1 everywhere), so the expected average is known; the
    order is the same on every rank (one seed), as a backward whose gradients come out of order
    would be. Returns the order buckets were flushed in, the bucket count and the gradients'
    distinct values after `finish_gradient_synchronization()`.
    """
    from labkit.experiments.common import seeded_model
    from labkit.models import GPTConfig

    model = seeded_model(GPTConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8), seed)
    ddp = ddp_class(model, bucket_cap_mb=bucket_cap_mb)
    flushed: list[int] = []
    flush = ddp._flush

    def recorded_flush(bucket: Any) -> None:  # record; stop before a wrong flush issues its collective
        flushed.append(bucket.index)
        if flushed != list(range(len(flushed))):
            raise _OutOfOrder(flushed)
        flush(bucket)

    ddp._flush = recorded_flush
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    values: list[float] = []  # stays empty when a flush came out of order
    try:
        for p in random.Random(seed).sample(params, len(params)):
            ddp._on_grad_ready(p)
        ddp.finish_gradient_synchronization()
        values = sorted({round(v, 6) for p in params for v in p.grad.unique().tolist()})
    except _OutOfOrder:
        pass
    return {"flushed": flushed, "buckets": len(ddp.buckets), "values": values, "rank": dist.get_rank()}


def check_overlapped_ddp(results: list[dict[str, Any]], world_size: int) -> None:
    """Lab 03: buckets flushed once each, in index order, and gradients averaged exactly once."""
    expected = (world_size + 1) / 2  # the mean of 1 .. world_size
    for r in results:
        k, flushed = r["buckets"], r["flushed"]
        again = [b for i, b in enumerate(flushed) if b in flushed[:i]]
        if again:
            raise AssertionError(
                f"rank {r['rank']}: bucket {again[0]} was flushed again (order {flushed}): flush each bucket once, "
                "and advance self._next_bucket after each flush.")
        if flushed != list(range(k)):
            raise AssertionError(
                f"rank {r['rank']} flushed buckets in the order {flushed}{'...' if len(flushed) < k else ''}, not 0, "
                f"1, ..., {k - 1}, with the hooks "
                "called in a shuffled order. Flush buckets in index order, never as they fill up: only "
                "self.buckets[self._next_bucket], once it is complete, then the next index while buckets are complete.")
        if r["values"] == [expected]:
            continue
        if r["values"] == [expected / world_size]:
            raise AssertionError(
                f"the gradients came out as {expected / world_size:g} instead of the mean {expected:g}: they were "
                "divided by the world size twice. finish_gradient_synchronization() already divides the "
                "all-reduced sum by world_size; in _flush copy the gradients as they are.")
        if r["values"] == [float(r["rank"] + 1)]:
            raise AssertionError(
                "the gradients are unchanged after finish_gradient_synchronization(): the buffer was not "
                "all-reduced, or did not receive the gradients. In _flush copy each p.grad into bucket.buffer at "
                "its offset, then dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True).")
        raise AssertionError(
            f"rank {r['rank']}: gradients {r['values'][:4]} after synchronisation, expected {expected:g} everywhere; "
            "check that every parameter's gradient lands at its own offset (zip bucket.params, bucket.offsets).")


def _scaled(g: torch.Tensor, ref: torch.Tensor, factor: float) -> bool:
    return torch.allclose(g, ref * factor, rtol=1e-4, atol=1e-6)


def check_accumulation(results: list[Any], reference: torch.Tensor, steps: int) -> float:
    """Lab 02: accumulated gradients equal the big batch's, with one all-reduce per bucket per optimizer
    step; `results` are `dp_train` results (`return_grads=True`). Returns the largest gradient error."""
    error = max((r.grads - reference).abs().max().item() for r in results)
    r0 = results[0]
    if r0.allreduce_calls == 0:
        raise AssertionError(
            "no all-reduce in the optimizer step: every backward ran inside no_sync(), so each rank kept only its "
            "own gradients. Run the last micro-batch outside `with ddp.no_sync():`; its backward all-reduces the "
            "accumulated sum.")
    if error >= 1e-5:
        g = results[0].grads
        if steps > 1 and _scaled(g, reference, (steps - 1) / steps):
            raise AssertionError(
                f"the gradients are {steps - 1}/{steps} of the big batch's: one micro-batch is missing. Run forward "
                "and backward for every (x, y) in batches, the last one included (outside no_sync).")
        if _scaled(g, reference, steps):
            raise AssertionError(
                f"the gradients are {steps}x the big batch's: divide each micro-batch's loss by len(batches) "
                "before backward, so that the sum over micro-steps is the mean.")
        raise AssertionError(
            f"gradients differ from the big batch's by {error:.2e}: divide every micro-batch loss by "
            "len(batches) and run backward for every micro-batch, the last one outside no_sync.")
    if r0.allreduce_calls != r0.buckets:
        raise AssertionError(
            f"{r0.allreduce_calls} all-reduces for {r0.buckets} buckets in one optimizer step: DDP all-reduced on "
            "every micro-step. Every micro-batch but the last must run inside `with ddp.no_sync():`, its forward "
            "as well as its backward (DDP decides in forward whether the next backward synchronises).")
    return error
