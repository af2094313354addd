"""What lab 03's figures may claim on the run they show.

The step-time bars are drawn with a limit line, max(compute, bucketed communication), and the bucket sweep
is read as a valley: too many small buckets on the left, one late bucket on the right. On a loaded machine
(or at sizes where an effect is small) a run can contradict either picture: a step bar under the limit, a
step faster than compute alone, or a sweep whose fastest point is at an end. These functions say so in
words, for the notebook to print under the figure instead of drawing a bound or a valley as if it held
(issue 44: a limit of 155 ms under a 163 ms "compute alone" bar, torch DDP at 158 ms, and a sweep falling
from 170.5 ms at one bucket per tensor to 169.8 ms at 0.125 MiB).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["bound_notes", "fixed_cost_line", "valley_note"]

# The steps that synchronise gradients: each does the compute and at least the bucketed communication
_SYNCED = {"naive": "naive", "overlapped": "overlapped", "torch_ddp": "torch DDP"}


def bound_notes(step_ms: Mapping[str, float], limit_ms: float) -> list[str]:
    """Where this run's bars contradict the bounds the figure draws (`step_ms`: ms per mode, among "compute",
    "naive", "overlapped", "torch_ddp"; `limit_ms`: the limit line). Empty when every bound holds."""
    notes = []
    compute = step_ms.get("compute")
    for mode, name in _SYNCED.items():
        ms = step_ms.get(mode)
        if ms is None:
            continue
        if ms < limit_ms:
            notes.append(f"{name} ({ms:.1f} ms) measured under the limit ({limit_ms:.1f} ms)")
        if compute is not None and ms < compute:
            notes.append(f"{name} ({ms:.1f} ms) measured faster than compute alone ({compute:.1f} ms)")
    if compute is not None and limit_ms < compute:
        notes.append(
            f"the limit ({limit_ms:.1f} ms, from the overlapped step's own compute) is under compute alone "
            f"({compute:.1f} ms), measured in another step"
        )
    if notes:
        notes.append(
            "no step can beat the work it does, so these differences are the run's own spread (another load "
            "on this machine moves the clocks between steps): read the limit as approximate on this run"
        )
    return notes


def valley_note(sweep: Sequence[Mapping[str, Any]], tolerance: float = 0.02) -> str:
    """Whether the bucket sweep (rows ordered from many small buckets to one, each with "step_ms" and
    "bucket_cap_mb") shows the valley the lab describes: its fastest size strictly inside, with both ends
    slower by more than `tolerance` (a fraction). A sentence either way."""
    times = [r["step_ms"] for r in sweep]
    best = min(range(len(times)), key=times.__getitem__)
    left, right = times[0] / times[best] - 1, times[-1] / times[best] - 1
    at = f"bucket_cap_mb={sweep[best]['bucket_cap_mb']:.3g} ({times[best]:.1f} ms)"
    if 0 < best < len(times) - 1 and left > tolerance and right > tolerance:
        return (
            f"the valley shows: fastest at {at}; one bucket per tensor {left:+.0%}, one bucket for the "
            f"model {right:+.0%}"
        )
    sides = []
    if left <= tolerance:
        sides.append(
            f"no left side: many small buckets cost within {tolerance:.0%} of the fastest ({left:+.1%}), "
            "so the host's cost per collective is too small to show at these sizes here"
        )
    if right <= tolerance:
        sides.append(
            f"no right side: one bucket for the model is within {tolerance:.0%} of the fastest ({right:+.1%})"
        )
    return f"no valley on this run (fastest at {at}): " + "; ".join(sides)


def fixed_cost_line(slope_ms: float, intercept_ms: float, where: str) -> str:
    """The straight-line fit of communication alone against the number of collectives, in words: a fixed
    cost per collective where the slope is positive, else that none shows."""
    if slope_ms > 0:
        return (
            f"communication alone ≈ {intercept_ms:.1f} ms + {slope_ms:.2f} ms per collective "
            f"(fit over the sweep, {where})"
        )
    return (
        f"communication alone ≈ {intercept_ms:.1f} ms whatever the number of collectives: no fixed cost per "
        f"collective shows in this sweep (fit slope {slope_ms:+.3f} ms, {where})"
    )
