"""Lab 02's checks. The exercise's: accumulated gradients against the big batch's, and DDP's all-reduces
counted; its hint names the mistake made (a micro-batch missing, the loss not divided, no_sync on every
micro-step) (`check_accumulation`). The end-to-end one: the step with every fix fits the memory the first
step did not, as the estimate says (`check_memory_fix`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ESTIMATE_WITHIN", "check_accumulation", "check_memory_fix"]


def _scaled(g: torch.Tensor, ref: torch.Tensor, factor: float) -> bool:
    return torch.allclose(g, ref * factor, rtol=1e-4, atol=1e-6)


def check_accumulation(results: list[Any] | None, reference: torch.Tensor, steps: int) -> float:
    """Lab 02: accumulated gradients equal the big batch's, with one all-reduce per bucket per optimizer
    step; `results` are `dp_train` results (`return_grads=True`), None where the exercise's run raised (its
    cell sets it to None first, so that a failed attempt is never checked by an earlier one's results).
    Returns the largest gradient error."""
    if results is None:
        raise AssertionError(
            "the exercise cell above did not finish: its last run stopped with the error printed under it. "
            "Fix `accumulate` there and run that cell again, then this one."
        )
    error = max((r.grads - reference).abs().max().item() for r in results)
    r0 = results[0]
    if r0.allreduce_calls == 0:
        raise AssertionError(
            "no all-reduce in the optimizer step: every backward ran inside no_sync(), so each rank kept "
            "only its own gradients. Run the last micro-batch outside `with ddp.no_sync():`; its backward "
            "all-reduces the accumulated sum."
        )
    if error >= 1e-5:
        g = results[0].grads
        if steps > 1 and _scaled(g, reference, (steps - 1) / steps):
            raise AssertionError(
                f"the gradients are {steps - 1}/{steps} of the big batch's: one micro-batch is missing. Run "
                "forward and backward for every (x, y) in batches, the last one included (outside no_sync)."
            )
        if _scaled(g, reference, steps):
            raise AssertionError(
                f"the gradients are {steps}x the big batch's: divide each micro-batch's loss by len(batches) "
                "before backward, so that the sum over micro-steps is the mean."
            )
        raise AssertionError(
            f"gradients differ from the big batch's by {error:.2e}: divide every micro-batch loss by "
            "len(batches) and run backward for every micro-batch, the last one outside no_sync."
        )
    if r0.allreduce_calls != r0.buckets:
        raise AssertionError(
            f"{r0.allreduce_calls} all-reduces for {r0.buckets} buckets in one optimizer step: DDP "
            "all-reduced on every micro-step. Every micro-batch but the last must run inside `with "
            "ddp.no_sync():`, its forward as well as its backward (DDP decides in forward whether the next "
            "backward synchronises)."
        )
    return error


ESTIMATE_WITHIN = 0.10  # the estimate's peak over the measured one, at most this far from 1


def check_memory_fix(before_mib: float, after_mib: float, memory_mib: float, estimate_ratio: float) -> float:
    """Lab 02's end-to-end check: the step as first written peaked at `before_mib` per rank, over the memory
    `memory_mib`; the step with the fixes (your `accumulate`, autocast, checkpointing, the micro-batch found)
    peaks at `after_mib`, within it; and the estimate of the fixed step over its measured peak,
    `estimate_ratio`, is within `ESTIMATE_WITHIN` of 1. Returns after_mib. AssertionError naming what failed,
    with the numbers and a hint."""
    if not memory_mib < before_mib:
        raise AssertionError(
            f"the step as first written peaked at {before_mib:.1f} MiB, within the {memory_mib} MiB per "
            "rank: there was no OOM to fix; hint: lower memory_mib or raise global_batch to see the mistake"
        )
    if not after_mib <= memory_mib:
        raise AssertionError(
            f"after {after_mib:.1f} MiB should fit in {memory_mib} MiB (before: {before_mib:.1f} MiB); hint: "
            "check the micro-batch chosen in section 5"
        )
    if not abs(estimate_ratio - 1) < ESTIMATE_WITHIN:
        why = (
            "the step held more than the estimate counts; hint: does accumulate keep a micro-batch's loss or "
            "outputs (and so its activations) alive after its backward?"
            if estimate_ratio < 1
            else "the step held less than the estimate counts; hint: compare the estimate's bars with the "
            "measured ones in the figure above"
        )
        raise AssertionError(
            f"the estimate is {estimate_ratio:.3f} x the measured peak, more than {ESTIMATE_WITHIN:.0%} off: "
            f"{why}"
        )
    return after_mib
